"""ptxattn's attention for JAX: an XLA FFI custom call with a custom VJP, usable under jax.jit.

``import ptxattn.jax`` (JAX is imported here only, never by ``import ptxattn``):

    out = ptxattn.jax.attention(q, k, v, causal=True)       # q: (batch, seqlen, heads, head_dim)
    out = ptxattn.jax.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 512, 512)  # packed
    loss, grads = jax.value_and_grad(f)(params)             # backward through ptxattn's kernels

How a call runs. Tracing checks the arguments with the rules of ptxattn/problem/ (on stand-ins
that carry the shapes and dtypes) and emits an ``ffi_call`` to one of four XLA FFI targets
registered for CUDA, the sinks (when given) passed last and their gradient returned last:

- ``ptxattn_attention_forward``: q, k, v [, sinks] -> out, lse;
- ``ptxattn_attention_backward``: dout, q, k, v, out, lse [, sinks] -> dq, dk, dv [, dsinks];
- ``ptxattn_attention_varlen_forward``: q, k, v, cu_seqlens_q, cu_seqlens_k [, sinks] ->
  out, lse;
- ``ptxattn_attention_varlen_backward``: dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k
  [, sinks] -> dq, dk, dv [, dsinks].

Their scalar attributes are causal, softmax_scale, window_left, window_right and softcap, with
max_seqlen_q and max_seqlen_k for varlen and deterministic for the backward. When XLA runs the
compiled program it calls the target's handler, a Python function behind a ctypes callback (no
C++ build), which views XLA's device buffers as CuPy arrays (zero-copy), makes XLA's stream
CuPy's current stream, and calls ptxattn.attention, attention_backward, attention_varlen or
attention_varlen_backward, which write into XLA's output buffers and queue their kernels on that
stream.

The handler speaks XLA's FFI C ABI (``xla/ffi/api/c_api.h``, shipped with jaxlib under
``jax.ffi.include_dir()``), declared below with ctypes: only the structs and fields this module
reads or writes. Each of them has kept its layout from FFI API 0.1 to 0.4 (jaxlib 0.10 speaks 0.3,
jaxlib 0.11 speaks 0.4; types were renamed and other fields and functions added, none of these
moved), so one declaration serves every jaxlib. When XLA registers the handler it asks which API
version the handler speaks; the handler answers with XLA's own (up to 0.4, the newest whose header
these declarations were checked against), refuses another major version (an ABI break), and says
that it is not safe to capture in a CUDA graph (ptxattn allocates workspace from CuPy's memory
pool on each call), so XLA calls it on every execution. Work goes through CuPy's pool, which
shares the GPU with XLA's own allocator: by default XLA takes 75% of the memory up front
(XLA_PYTHON_CLIENT_MEM_FRACTION), and the backward's workspace (about ``B*Hq*Sq*(D+2)*4``
bytes, docs/guide/backward.md) comes out of the rest.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import functools
import math
import threading
import types

import jax
import ml_dtypes
import numpy as np

from .problem import AttentionProblem

__all__ = ["attention", "attention_varlen"]


def __dir__():
    return sorted(__all__)


FORWARD_TARGET = "ptxattn_attention_forward"
BACKWARD_TARGET = "ptxattn_attention_backward"
VARLEN_FORWARD_TARGET = "ptxattn_attention_varlen_forward"
VARLEN_BACKWARD_TARGET = "ptxattn_attention_varlen_backward"

# ---------------------------------------------------------------------------------------------
# The XLA FFI C ABI (c_api.h), LP64: the parts a handler that reads buffers and scalar attributes,
# asks for the stream and reports errors needs. Field names are the header's.


class ExtensionType(enum.IntEnum):
    METADATA = 1  # XLA_FFI_Extension_Metadata


class ExecutionStage(enum.IntEnum):
    INSTANTIATE = 0
    PREPARE = 1
    INITIALIZE = 2
    EXECUTE = 3
    RECORD = 4  # API 0.4: CUDA-graph recording, a bundle's record handler's (none here)


class ErrorCode(enum.IntEnum):
    """The XLA_FFI_Error_Code values (absl status codes) that the handler reports."""
    INVALID_ARGUMENT = 3
    INTERNAL = 13


class DataType(enum.IntEnum):
    """The XLA_FFI_DataType (xla::PrimitiveType) values of the buffers and attributes used here."""
    PRED = 1
    S32 = 4
    S64 = 5
    F16 = 10
    F32 = 11
    F64 = 12
    BF16 = 16


ARG_BUFFER = 1   # XLA_FFI_ArgType_BUFFER
RET_BUFFER = 1   # XLA_FFI_RetType_BUFFER
ATTR_SCALAR = 3  # XLA_FFI_AttrType_SCALAR

# The FFI API versions whose c_api.h the declarations below match (the tests hold them to the
# installed jaxlib's header): major 0, minors 1 (the oldest XLA accepts) to 4 (jaxlib 0.11).
API_MAJOR = 0
API_MINORS = range(1, 5)

NUMPY_DTYPES = {
    DataType.PRED: np.dtype(np.bool_),
    DataType.S32: np.dtype(np.int32),
    DataType.S64: np.dtype(np.int64),
    DataType.F16: np.dtype(np.float16),
    DataType.F32: np.dtype(np.float32),
    DataType.F64: np.dtype(np.float64),
    DataType.BF16: np.dtype(ml_dtypes.bfloat16),
}


class XLA_FFI_InternalExtension(ctypes.Structure):
    """XLA_FFI_Extension_Base before API 0.4, which renamed it when it added a generic
    XLA_FFI_Extension for execution contexts (not used here)."""


XLA_FFI_InternalExtension._fields_ = [
    ("struct_size", ctypes.c_size_t),
    ("type", ctypes.c_int),  # XLA_FFI_InternalExtension_Type
    ("next", ctypes.POINTER(XLA_FFI_InternalExtension)),
]


class XLA_FFI_Api_Version(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("major_version", ctypes.c_int),
        ("minor_version", ctypes.c_int),
    ]


class XLA_FFI_Metadata(ctypes.Structure):
    # Newer headers append fields (state_type_id); the handler writes only these.
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("api_version", XLA_FFI_Api_Version),
        ("traits", ctypes.c_uint32),  # XLA_FFI_Handler_Traits; 0: not CUDA-graph safe
    ]


class XLA_FFI_Metadata_Extension(ctypes.Structure):
    _fields_ = [
        ("extension_base", XLA_FFI_InternalExtension),
        ("metadata", ctypes.POINTER(XLA_FFI_Metadata)),
    ]


class XLA_FFI_ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class XLA_FFI_Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class XLA_FFI_Buffer(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("dtype", ctypes.c_int),  # XLA_FFI_DataType
        ("data", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dims", ctypes.POINTER(ctypes.c_int64)),
    ]


class XLA_FFI_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),  # XLA_FFI_ArgType[size]
        ("args", ctypes.POINTER(ctypes.c_void_p)),
    ]


class XLA_FFI_Rets(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),  # XLA_FFI_RetType[size]
        ("rets", ctypes.POINTER(ctypes.c_void_p)),
    ]


class XLA_FFI_Attrs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("size", ctypes.c_int64),
        ("types", ctypes.POINTER(ctypes.c_int)),  # XLA_FFI_AttrType[size]
        ("names", ctypes.POINTER(ctypes.POINTER(XLA_FFI_ByteSpan))),
        ("attrs", ctypes.POINTER(ctypes.c_void_p)),
    ]


class XLA_FFI_Error_Create_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),  # XLA_FFI_Error_Code
    ]


class XLA_FFI_Stream_Get_Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("ctx", ctypes.c_void_p),  # XLA_FFI_ExecutionContext*
        ("stream", ctypes.c_void_p),  # out: the CUstream
    ]


# The API functions return an XLA_FFI_Error* (NULL on success), here an address or None.
XLA_FFI_Error_Create = ctypes.CFUNCTYPE(ctypes.c_void_p,
                                        ctypes.POINTER(XLA_FFI_Error_Create_Args))
XLA_FFI_Stream_Get = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(XLA_FFI_Stream_Get_Args))


class XLA_FFI_Api(ctypes.Structure):
    """The head of XLA's function table, up to the last entry used here: these slots have kept
    their places since API 0.1 (later entries were inserted and renamed, which is why the table is
    declared no further)."""
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("api_version", XLA_FFI_Api_Version),
        ("internal_api", ctypes.c_void_p),
        ("XLA_FFI_Error_Create", XLA_FFI_Error_Create),
        ("XLA_FFI_Error_GetDetails", ctypes.c_void_p),  # XLA_FFI_Error_GetMessage before 0.4
        ("XLA_FFI_Error_Destroy", ctypes.c_void_p),
        ("XLA_FFI_Handler_Register", ctypes.c_void_p),
        ("XLA_FFI_Stream_Get", XLA_FFI_Stream_Get),
    ]


class XLA_FFI_CallFrame(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.POINTER(XLA_FFI_InternalExtension)),
        ("api", ctypes.POINTER(XLA_FFI_Api)),
        ("ctx", ctypes.c_void_p),  # XLA_FFI_ExecutionContext*
        ("stage", ctypes.c_int),  # XLA_FFI_ExecutionStage
        ("args", XLA_FFI_Args),
        ("rets", XLA_FFI_Rets),
        ("attrs", XLA_FFI_Attrs),
        ("future", ctypes.c_void_p),  # out, for asynchronous handlers; left NULL
    ]


XLA_FFI_Handler = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(XLA_FFI_CallFrame))


def struct_size(struct: type[ctypes.Structure], last_field: str) -> int:
    """XLA_FFI_STRUCT_SIZE: the bytes up to the end of ``last_field``, what the caller of an API
    function puts in ``struct_size`` to say which fields it knows."""
    field = getattr(struct, last_field)
    return field.offset + field.size


# ---------------------------------------------------------------------------------------------
# Handlers: a Python function behind an XLA_FFI_Handler


class XlaError(Exception):
    """An XLA_FFI_Error* that an API function returned: the handler hands it on to XLA."""

    def __init__(self, what: str, address: int):
        super().__init__(f"{what} returned an XLA FFI error")
        self.address = address


class FfiCall:
    """One execution of a handler, read from its XLA_FFI_CallFrame: buffers, scalar attributes
    and the stream."""

    def __init__(self, frame: XLA_FFI_CallFrame):
        self._frame = frame

    @property
    def args(self) -> list[XLA_FFI_Buffer]:
        return _buffers(self._frame.args.size, self._frame.args.types, self._frame.args.args,
                        ARG_BUFFER, "argument")

    @property
    def rets(self) -> list[XLA_FFI_Buffer]:
        return _buffers(self._frame.rets.size, self._frame.rets.types, self._frame.rets.rets,
                        RET_BUFFER, "result")

    @property
    def attrs(self) -> dict[str, object]:
        """Name -> Python value of each scalar attribute."""
        attrs = self._frame.attrs
        values = {}
        for i in range(attrs.size):
            span = attrs.names[i].contents
            name = ctypes.string_at(span.ptr, span.len).decode()
            if attrs.types[i] != ATTR_SCALAR:
                raise TypeError(f"attribute {name!r} has FFI type {attrs.types[i]}; only scalar "
                                "attributes are read here")
            scalar = ctypes.cast(attrs.attrs[i], ctypes.POINTER(XLA_FFI_Scalar)).contents
            dtype = NUMPY_DTYPES.get(scalar.dtype)
            if dtype is None:
                raise TypeError(f"attribute {name!r} has XLA data type {scalar.dtype}, which is "
                                "not read here")
            raw = ctypes.string_at(scalar.value, dtype.itemsize)
            values[name] = np.frombuffer(raw, dtype=dtype)[0].item()
        return values

    def stream(self) -> int:
        """The CUstream XLA runs this call on."""
        request = XLA_FFI_Stream_Get_Args(
            struct_size=struct_size(XLA_FFI_Stream_Get_Args, "stream"), ctx=self._frame.ctx)
        error = self._frame.api.contents.XLA_FFI_Stream_Get(ctypes.byref(request))
        if error:
            raise XlaError("XLA_FFI_Stream_Get", error)
        return request.stream or 0


def _buffers(count: int, kinds, pointers, buffer_kind: int, what: str) -> list[XLA_FFI_Buffer]:
    buffers = []
    for i in range(count):
        if kinds[i] != buffer_kind:
            raise TypeError(f"{what} {i} has FFI type {kinds[i]}, not a buffer")
        buffers.append(ctypes.cast(pointers[i], ctypes.POINTER(XLA_FFI_Buffer)).contents)
    return buffers


def _metadata_request(frame: XLA_FFI_CallFrame):
    """The XLA_FFI_Metadata to fill in if this call is XLA's metadata query (made when the target
    is registered: a metadata extension on the call frame's chain), else None."""
    extension = frame.extension_start
    while extension:
        if extension.contents.type == ExtensionType.METADATA:
            request = ctypes.cast(extension, ctypes.POINTER(XLA_FFI_Metadata_Extension))
            return request.contents.metadata.contents
        extension = extension.contents.next
    return None


def handler_api_version(xla_version: tuple[int, int] | None) -> tuple[int, int]:
    """The FFI API version the handler speaks to an XLA that speaks ``xla_version``: XLA's own up
    to the newest declared here (XLA accepts handlers of older minor versions, and keeps accepting
    a minor version for at least a year after a newer one; answering with its own keeps ptxattn
    registrable when it drops 0.1). ``None``, a query that carries no API table, gets the oldest.
    Another major version is an ABI break: a ValueError."""
    if xla_version is None:
        return (API_MAJOR, API_MINORS[0])
    major, minor = xla_version
    if major != API_MAJOR or minor < API_MINORS[0]:
        raise ValueError(f"XLA speaks FFI API {major}.{minor}; ptxattn.jax declares the C ABI of "
                         f"{API_MAJOR}.{API_MINORS[0]} to {API_MAJOR}.{API_MINORS[-1]} only")
    return (major, min(minor, API_MINORS[-1]))


def _answer_metadata(frame: XLA_FFI_CallFrame, metadata: XLA_FFI_Metadata) -> None:
    """Fills in the metadata query: the API version the handler speaks and no traits."""
    xla_version = None
    if frame.api:
        version = frame.api.contents.api_version
        xla_version = (version.major_version, version.minor_version)
    major, minor = handler_api_version(xla_version)
    metadata.api_version = XLA_FFI_Api_Version(
        struct_size=struct_size(XLA_FFI_Api_Version, "minor_version"),
        major_version=major, minor_version=minor)
    metadata.traits = 0


def _error(frame: XLA_FFI_CallFrame, code: ErrorCode, message: str) -> int:
    """A new XLA_FFI_Error* carrying ``message``; XLA owns and frees what a handler returns."""
    request = XLA_FFI_Error_Create_Args(
        struct_size=struct_size(XLA_FFI_Error_Create_Args, "errc"),
        message=message.encode("utf-8", errors="replace"), errc=code)
    return frame.api.contents.XLA_FFI_Error_Create(ctypes.byref(request))


def ffi_handler(target: str, body) -> XLA_FFI_Handler:
    """An XLA_FFI_Handler that answers the metadata query (handler_api_version) and runs
    ``body(FfiCall)`` at the execute stage. Whatever ``body`` raises becomes an XLA error with the
    Python message (an exception must not cross the C boundary: ctypes would print it and report
    success). The caller keeps the returned object alive as long as XLA may call it."""

    def handle(frame_pointer) -> int | None:
        frame = frame_pointer.contents
        try:
            metadata = _metadata_request(frame)
            if metadata is not None:
                _answer_metadata(frame, metadata)
                return None
            if frame.stage != ExecutionStage.EXECUTE:
                return _error(frame, ErrorCode.INTERNAL,
                              f"{target}: called at stage {frame.stage}; ptxattn registers an "
                              "execute handler only")
            body(FfiCall(frame))
            return None
        except XlaError as e:
            return e.address
        except (TypeError, ValueError) as e:
            return _error(frame, ErrorCode.INVALID_ARGUMENT, f"{target}: {type(e).__name__}: {e}")
        except BaseException as e:  # noqa: BLE001 - every failure goes back to XLA as an error
            return _error(frame, ErrorCode.INTERNAL, f"{target}: {type(e).__name__}: {e}")

    return XLA_FFI_Handler(handle)


def register(target: str, handler: XLA_FFI_Handler, platform: str) -> None:
    """Registers ``handler`` as the execute handler of the FFI target ``target``."""
    address = ctypes.cast(handler, ctypes.c_void_p).value
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(address), platform=platform)


# ---------------------------------------------------------------------------------------------
# The attention handlers: XLA buffers as CuPy arrays, XLA's stream as CuPy's


class _CudaStream:
    """A CUstream address offered through the CUDA stream protocol, for
    cupy.cuda.Stream.from_external."""

    def __init__(self, address: int):
        self.address = address

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.address)


_streams: dict[int, object] = {}  # CUstream address -> its cupy Stream
_streams_lock = threading.Lock()


def _cupy_stream(address: int):
    import cupy
    with _streams_lock:
        stream = _streams.get(address)
        if stream is None:
            stream = _streams[address] = cupy.cuda.Stream.from_external(_CudaStream(address))
    return stream


def _cupy_view(buffer: XLA_FFI_Buffer, device_id: int, rank: int):
    """A zero-copy CuPy array over an XLA buffer (row-major, ffi_call's default layout), with any
    leading dimensions beyond ``rank`` folded into the first (vmap's batch dimensions)."""
    import cupy

    dtype = NUMPY_DTYPES.get(buffer.dtype)
    if dtype is None:
        raise TypeError(f"buffer of XLA data type {buffer.dtype} is not read here")
    dims = [buffer.dims[i] for i in range(buffer.rank)]
    shape = (math.prod(dims[:len(dims) - rank + 1]), *dims[len(dims) - rank + 1:])
    memory = cupy.cuda.UnownedMemory(buffer.data, math.prod(dims) * dtype.itemsize, owner=None,
                                     device_id=device_id)
    return cupy.ndarray(shape, dtype=dtype, memptr=cupy.cuda.MemoryPointer(memory, 0))


def _instance_count(buffer: XLA_FFI_Buffer, rank: int) -> int:
    """How many vmapped instances of an operand of ``rank`` dimensions ``buffer`` holds: the
    product of its leading dimensions beyond ``rank``, 1 outside vmap."""
    return math.prod(buffer.dims[i] for i in range(buffer.rank - rank))


def _instance_views(buffer: XLA_FFI_Buffer, device_id: int, rank: int, instances: int):
    """``buffer`` as ``instances`` operands of ``rank`` dimensions, stacked along a new leading
    axis: vmap's leading dimensions split into that many instances, the rest folded into each
    operand's first dimension (_cupy_view)."""
    view = _cupy_view(buffer, device_id, rank)
    return view.reshape(instances, view.shape[0] // instances, *view.shape[1:])


def _optional_instance_views(buffers: list[XLA_FFI_Buffer], index: int, device_id: int,
                             rank: int, instances: int):
    """_instance_views of ``buffers[index]``, an optional operand that comes last when it is
    passed (the sinks, their gradient), or one None per instance when it is not."""
    if len(buffers) <= index:
        return [None] * instances
    return _instance_views(buffers[index], device_id, rank, instances)


def _device_of(buffer: XLA_FFI_Buffer) -> int:
    import cupy
    return cupy.cuda.runtime.pointerGetAttributes(buffer.data).device


def _options(attrs: dict) -> dict:
    """ptxattn's keyword arguments for the masking and scores of a call, from its attributes."""
    return {"causal": attrs["causal"], "softmax_scale": attrs["softmax_scale"],
            "window": (attrs["window_left"], attrs["window_right"]),
            "softcap": attrs["softcap"]}


# vmap (ffi_call's "broadcast_all") gives every operand the same leading dimensions. In the
# fixed-length calls they fold into the batch, one launch, unless sinks are passed: vmap broadcasts
# those to one row per instance, and the rows may differ, so each instance gets its own launch
# (dsinks too, one row each). In the varlen calls each instance's cu_seqlens index its own q, k
# and v: one launch per instance always.


def _run_forward(call: FfiCall) -> None:
    import cupy

    from . import attention as ptxattn_attention

    attrs, args, rets = call.attrs, call.args, call.rets
    device_id = _device_of(args[0])
    instances = _instance_count(args[3], 1) if len(args) > 3 else 1
    q, k, v = (_instance_views(b, device_id, 4, instances) for b in args[:3])
    sinks = _optional_instance_views(args, 3, device_id, 1, instances)
    out = _instance_views(rets[0], device_id, 4, instances)
    lse = _instance_views(rets[1], device_id, 3, instances)
    with cupy.cuda.Device(device_id), _cupy_stream(call.stream()):
        for i in range(instances):
            ptxattn_attention(q[i], k[i], v[i], sinks=sinks[i], out=out[i], lse=lse[i],
                              **_options(attrs))


def _run_backward(call: FfiCall) -> None:
    import cupy

    from . import attention_backward

    attrs, args, rets = call.attrs, call.args, call.rets
    device_id = _device_of(args[0])
    instances = _instance_count(args[6], 1) if len(args) > 6 else 1
    dout, q, k, v, out = (_instance_views(b, device_id, 4, instances) for b in args[:5])
    lse = _instance_views(args[5], device_id, 3, instances)
    sinks = _optional_instance_views(args, 6, device_id, 1, instances)
    dq, dk, dv = (_instance_views(b, device_id, 4, instances) for b in rets[:3])
    dsinks = _optional_instance_views(rets, 3, device_id, 1, instances)
    with cupy.cuda.Device(device_id), _cupy_stream(call.stream()):
        for i in range(instances):
            attention_backward(dout[i], q[i], k[i], v[i], out[i], lse[i], sinks=sinks[i],
                               deterministic=attrs["deterministic"], dq=dq[i], dk=dk[i],
                               dv=dv[i], dsinks=dsinks[i], **_options(attrs))


# The varlen calls pass check_contents=False: checking the cu_seqlens would copy them to the host,
# a synchronization inside XLA's program, and their values are the caller's to get right (they
# were traced, so they could not be checked when the call was traced either).


def _run_varlen_forward(call: FfiCall) -> None:
    import cupy

    from . import attention_varlen as ptxattn_attention_varlen

    attrs, args, rets = call.attrs, call.args, call.rets
    device_id = _device_of(args[0])
    instances = _instance_count(args[3], 1)
    q, k, v = (_instance_views(b, device_id, 3, instances) for b in args[:3])
    cu_seqlens_q, cu_seqlens_k = (_instance_views(b, device_id, 1, instances) for b in args[3:5])
    sinks = _optional_instance_views(args, 5, device_id, 1, instances)
    out = _instance_views(rets[0], device_id, 3, instances)
    lse = _instance_views(rets[1], device_id, 2, instances)
    with cupy.cuda.Device(device_id), _cupy_stream(call.stream()):
        for i in range(instances):
            ptxattn_attention_varlen(q[i], k[i], v[i], cu_seqlens_q[i], cu_seqlens_k[i],
                                     attrs["max_seqlen_q"], attrs["max_seqlen_k"],
                                     sinks=sinks[i], out=out[i], lse=lse[i],
                                     check_contents=False, **_options(attrs))


def _run_varlen_backward(call: FfiCall) -> None:
    import cupy

    from . import attention_varlen_backward

    attrs, args, rets = call.attrs, call.args, call.rets
    device_id = _device_of(args[0])
    instances = _instance_count(args[6], 1)
    dout, q, k, v, out = (_instance_views(b, device_id, 3, instances) for b in args[:5])
    lse = _instance_views(args[5], device_id, 2, instances)
    cu_seqlens_q, cu_seqlens_k = (_instance_views(b, device_id, 1, instances) for b in args[6:8])
    sinks = _optional_instance_views(args, 8, device_id, 1, instances)
    dq, dk, dv = (_instance_views(b, device_id, 3, instances) for b in rets[:3])
    dsinks = _optional_instance_views(rets, 3, device_id, 1, instances)
    with cupy.cuda.Device(device_id), _cupy_stream(call.stream()):
        for i in range(instances):
            attention_varlen_backward(dout[i], q[i], k[i], v[i], out[i], lse[i],
                                      cu_seqlens_q[i], cu_seqlens_k[i], attrs["max_seqlen_q"],
                                      attrs["max_seqlen_k"], sinks=sinks[i],
                                      deterministic=attrs["deterministic"], dq=dq[i],
                                      dk=dk[i], dv=dv[i], dsinks=dsinks[i],
                                      check_contents=False, **_options(attrs))


# Module-level, so that the callbacks live as long as XLA may call them.
_forward_handler = ffi_handler(FORWARD_TARGET, _run_forward)
_backward_handler = ffi_handler(BACKWARD_TARGET, _run_backward)
_varlen_forward_handler = ffi_handler(VARLEN_FORWARD_TARGET, _run_varlen_forward)
_varlen_backward_handler = ffi_handler(VARLEN_BACKWARD_TARGET, _run_varlen_backward)
register(FORWARD_TARGET, _forward_handler, platform="CUDA")
register(BACKWARD_TARGET, _backward_handler, platform="CUDA")
register(VARLEN_FORWARD_TARGET, _varlen_forward_handler, platform="CUDA")
register(VARLEN_BACKWARD_TARGET, _varlen_backward_handler, platform="CUDA")


# ---------------------------------------------------------------------------------------------
# The JAX functions


@dataclasses.dataclass(frozen=True)
class _XlaOperand:
    """What the checks of ptxattn/problem/ read of an array, for an operand of the FFI call: its
    shape and dtype, row-major strides (the layout ffi_call asks XLA for) and a placeholder
    address and device, as XLA places its buffers (aligned to at least 64 bytes) on the device it
    runs on."""

    shape: tuple[int, ...]
    dtype: np.dtype
    data = types.SimpleNamespace(ptr=0)
    device = types.SimpleNamespace(id=0)

    @classmethod
    def like(cls, x):
        """A stand-in for ``x``, or ``x`` itself when it is no array (the checks refuse it, or
        take None for an optional operand)."""
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            return x
        return cls(tuple(x.shape), np.dtype(x.dtype))

    def __getitem__(self, index):
        """``x[None]``, the operand with a leading axis of 1: the only indexing the checks do
        (the varlen ones hold 3-d operands to the rules of 4-d ones)."""
        if index is not None:
            raise TypeError(f"a stand-in of an XLA operand takes x[None] only, got {index!r}")
        return dataclasses.replace(self, shape=(1, *self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def strides(self) -> tuple[int, ...]:
        strides, step = [], self.itemsize
        for n in reversed(self.shape):
            strides.insert(0, step)
            step *= n
        return tuple(strides)


@dataclasses.dataclass(frozen=True)
class _Attributes:
    """The static attributes of one attention's FFI calls, checked: what the handlers pass on to
    ptxattn. Hashable, as custom_vjp's non-differentiable arguments must be."""

    causal: bool
    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    deterministic: bool
    max_seqlens: tuple[int, int] | None = None  # (max_seqlen_q, max_seqlen_k) of a varlen call

    @classmethod
    def of(cls, problem: AttentionProblem, deterministic: bool) -> "_Attributes":
        max_seqlens = ((problem.seqlen_q, problem.seqlen_k) if "varlen" in problem.layouts
                       else None)
        return cls(problem.causal, problem.softmax_scale, problem.window, problem.softcap,
                   deterministic, max_seqlens)

    def forward(self) -> dict:
        """The forward call's attributes, as ffi_call takes them: NumPy scalars, whose dtypes
        are the attributes' XLA types."""
        attrs = {"causal": np.bool_(self.causal), "softmax_scale": np.float64(self.softmax_scale),
                 "window_left": np.int64(self.window[0]),
                 "window_right": np.int64(self.window[1]), "softcap": np.float64(self.softcap)}
        if self.max_seqlens is not None:
            attrs["max_seqlen_q"], attrs["max_seqlen_k"] = (np.int64(n) for n in self.max_seqlens)
        return attrs

    def backward(self) -> dict:
        """The backward call's attributes: the forward's and ``deterministic``."""
        return {**self.forward(), "deterministic": np.bool_(self.deterministic)}


def _check_deterministic(deterministic) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")


def _forward_call(target: str, operands: tuple, sinks, result_types: tuple,
                  attributes: _Attributes):
    """(out, lse) from the forward target ``target`` on ``operands``, and ``sinks`` after them
    when given."""
    if sinks is not None:
        operands = (*operands, sinks)
    call = jax.ffi.ffi_call(target, result_types, vmap_method="broadcast_all")
    return call(*operands, **attributes.forward())


def _backward_call(target: str, operands: tuple, sinks, attributes: _Attributes) -> tuple:
    """(dq, dk, dv, dsinks) from the backward target ``target`` on ``operands`` (dout, q, k, v,
    out, lse, and for varlen the cu_seqlens), and ``sinks`` after them when given; dsinks is None
    without sinks."""
    q, k, v = operands[1:4]
    result_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    if sinks is not None:
        operands = (*operands, sinks)
        result_types.append(jax.ShapeDtypeStruct(sinks.shape, np.float32))
    call = jax.ffi.ffi_call(target, tuple(result_types), vmap_method="broadcast_all")
    dq, dk, dv, *dsinks = call(*operands, **attributes.backward())
    return dq, dk, dv, (dsinks[0] if dsinks else None)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              window=(-1, -1), softcap: float = 0.0, sinks=None, deterministic: bool = False):
    """Scaled dot-product attention, ``softmax(softmax_scale * q k^T) v``, for JAX on CUDA.

    An XLA FFI custom call (module docstring) with a custom VJP: differentiable in reverse
    mode (jax.grad, jax.vjp) in q, k, v and ``sinks`` through ``ptxattn.attention_backward``,
    usable under jax.jit and jax.vmap (vmapped dimensions are folded into batch; with sinks,
    which may differ between instances, each instance is a call of its own). The kernels run on
    XLA's stream, into XLA's buffers. Bad arguments raise when the call is traced, with
    ``ptxattn.attention``'s messages, rather than inside XLA.

    Parameters
    ----------
    q : jax.Array
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device;
        head_dim a multiple of 8 from 8 to 256.
    k : jax.Array
        Keys, (batch, seqlen_k, heads_kv, head_dim), q's dtype; heads_q a multiple of heads_kv
        (GQA/MQA).
    v : jax.Array
        Values, (batch, seqlen_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a
        multiple of 8 at most head_dim (narrower value heads, as in multi-head latent
        attention).
    causal : bool, default False
        Masks key j from query i unless j <= i + seqlen_k - seqlen_q (bottom-right aligned,
        as in ``ptxattn.attention``). A row that sees no key gives output 0.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        (left, right): query i sees keys i + seqlen_k - seqlen_q - left up to
        i + seqlen_k - seqlen_q + right, -1 meaning unbounded (right is 0 when causal).
        Static, like ``causal``.
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap); 0 turns it off.
        Static.
    sinks : jax.Array, optional
        float32 (heads_q,): one logit per q head that joins every row's softmax denominator and
        adds nothing to the output. Its gradient is summed over batch and rows.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.

    Returns
    -------
    jax.Array
        The output, (batch, seqlen_q, heads_q, head_dim_v) in q's dtype.

    Raises
    ------
    TypeError
        q, k or v not arrays, not float16 or bfloat16, or not of one dtype; ``sinks`` not a
        float32 array; ``causal`` or ``deterministic`` not a bool.
    ValueError
        A shape (not 4-d, empty, k and v unlike but for head_dim_v, batch or k's head_dim
        unlike q's, heads_q not a multiple of heads_kv, ``sinks`` not (heads_q,)); head_dim or
        head_dim_v outside the rule above; a bad ``softmax_scale``, ``window`` or ``softcap``.

    Examples
    --------
    >>> import jax, jax.numpy as jnp
    >>> import ptxattn.jax
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> q, k, v = (jax.random.normal(key, (2, 1024, 16, 128), jnp.bfloat16) for key in keys)
    >>> out = jax.jit(ptxattn.jax.attention, static_argnames="causal")(q, k, v, causal=True)
    >>> def loss(q, k, v):
    ...     return ptxattn.jax.attention(q, k, v, causal=True).astype(jnp.float32).sum()
    >>> dq, dk, dv = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    A sliding window of 256 keys back, a logit softcap and a sink per head, differentiable in
    the sinks too:

    >>> sinks = jnp.zeros(16, jnp.float32)
    >>> def loss(q, k, v, sinks):
    ...     out = ptxattn.jax.attention(q, k, v, causal=True, window=(256, 0), softcap=30.0,
    ...                                 sinks=sinks)
    ...     return out.astype(jnp.float32).sum()
    >>> dq, dk, dv, dsinks = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
    """
    # ptxattn's checks, on stand-ins at trace time: a bad call fails here with ptxattn's
    # message rather than inside XLA.
    _check_deterministic(deterministic)
    problem = AttentionProblem.from_16bit(
        _XlaOperand.like(q), _XlaOperand.like(k), _XlaOperand.like(v), causal=causal,
        softmax_scale=softmax_scale, window=window, softcap=softcap,
        sinks=_XlaOperand.like(sinks))
    return _attention(q, k, v, sinks, _Attributes.of(problem, deterministic))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, sinks, attributes):
    out, _ = _attention_forward(q, k, v, sinks, attributes)
    return out


def _attention_forward(q, k, v, sinks, attributes):
    batch, seqlen_q, heads_q, _ = q.shape
    result_types = (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
                    jax.ShapeDtypeStruct((batch, heads_q, seqlen_q), np.float32))
    out, lse = _forward_call(FORWARD_TARGET, (q, k, v), sinks, result_types, attributes)
    return out, (q, k, v, sinks, out, lse)


def _attention_backward(attributes, residuals, dout):
    q, k, v, sinks, out, lse = residuals
    return _backward_call(BACKWARD_TARGET, (dout, q, k, v, out, lse), sinks, attributes)


_attention.defvjp(_attention_forward, _attention_backward)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     *, causal: bool = False, softmax_scale: float | None = None,
                     window=(-1, -1), softcap: float = 0.0, sinks=None,
                     deterministic: bool = False):
    """Attention over packed sequences of their own lengths, for JAX on CUDA.

    ``ptxattn.attention_varlen`` as an XLA FFI custom call with a custom VJP: differentiable in
    reverse mode in q, k, v and ``sinks`` through ``ptxattn.attention_varlen_backward``, usable
    under jax.jit (``max_seqlen_q`` and ``max_seqlen_k`` static) and jax.vmap (each instance a
    call of its own). Sequence b holds rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] of q and rows
    cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v; empty sequences are allowed. The contents
    of the cu_seqlens are not checked (they are device values, and checking them would stop the
    program to copy them to the host): they must start at 0, never decrease, end at total_q and
    total_k and hold no sequence longer than its maximum.

    Parameters
    ----------
    q : jax.Array
        Queries, (total_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device; head_dim
        a multiple of 8 from 8 to 256.
    k : jax.Array
        Keys, (total_k, heads_kv, head_dim), q's dtype; heads_q a multiple of heads_kv
        (GQA/MQA).
    v : jax.Array
        Values, (total_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a multiple of 8
        at most head_dim.
    cu_seqlens_q, cu_seqlens_k : jax.Array
        int32, batch + 1 >= 2 entries each: the sequences' cumulative lengths. No gradient.
    max_seqlen_q, max_seqlen_k : int
        Non-negative bounds on the sequences' query and key lengths; static.
    causal : bool, default False
        Masks key j from query i of a sequence unless j <= i + seqlen_k - seqlen_q, with that
        sequence's lengths (bottom-right aligned per sequence). A row that sees no key gives
        output 0.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        (left, right) keys around each sequence's diagonal, as in ``attention``; -1 is
        unbounded, right is 0 when causal. Static.
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap); 0 turns it off.
        Static.
    sinks : jax.Array, optional
        float32 (heads_q,): one logit per q head that joins every row's softmax denominator and
        adds nothing to the output. Its gradient is summed over all rows.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.

    Returns
    -------
    jax.Array
        The output, (total_q, heads_q, head_dim_v) in q's dtype.

    Raises
    ------
    TypeError
        q, k or v not arrays of one float16 or bfloat16 dtype; the cu_seqlens not int32;
        ``sinks`` not float32; ``causal`` or ``deterministic`` not a bool.
    ValueError
        A shape (q, k, v not 3-d or empty, k and v unlike but for head_dim_v, heads_q not a
        multiple of heads_kv, ``sinks`` not (heads_q,)); head_dim or head_dim_v outside the
        rule above; cu_seqlens not 1-d, of unlike shapes or of fewer than 2 entries; a
        max_seqlen that is not a non-negative int; a bad ``softmax_scale``, ``window`` or
        ``softcap``.

    Examples
    --------
    Three sequences of 5, 0 and 11 tokens, causal self-attention, and its gradients:

    >>> import jax, jax.numpy as jnp
    >>> import ptxattn.jax
    >>> cu_seqlens = jnp.array([0, 5, 5, 16], jnp.int32)
    >>> keys = jax.random.split(jax.random.key(0), 3)
    >>> q = jax.random.normal(keys[0], (16, 32, 128), jnp.bfloat16)
    >>> k, v = (jax.random.normal(key, (16, 8, 128), jnp.bfloat16) for key in keys[1:])
    >>> def loss(q, k, v):
    ...     out = ptxattn.jax.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 11, 11,
    ...                                        causal=True)
    ...     return out.astype(jnp.float32).sum()
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    """
    _check_deterministic(deterministic)  # and ptxattn's checks, as in attention
    problem = AttentionProblem.from_varlen(
        _XlaOperand.like(q), _XlaOperand.like(k), _XlaOperand.like(v),
        _XlaOperand.like(cu_seqlens_q), _XlaOperand.like(cu_seqlens_k), max_seqlen_q,
        max_seqlen_k, causal=causal, window=window, softcap=softcap,
        sinks=_XlaOperand.like(sinks), softmax_scale=softmax_scale)
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks,
                             _Attributes.of(problem, deterministic))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, attributes):
    out, _ = _attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks,
                                       attributes)
    return out


def _attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, attributes):
    total_q, heads_q, _ = q.shape
    result_types = (jax.ShapeDtypeStruct((*q.shape[:-1], v.shape[-1]), q.dtype),
                    jax.ShapeDtypeStruct((heads_q, total_q), np.float32))
    out, lse = _forward_call(VARLEN_FORWARD_TARGET, (q, k, v, cu_seqlens_q, cu_seqlens_k), sinks,
                             result_types, attributes)
    return out, (q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse)


def _attention_varlen_backward(attributes, residuals, dout):
    q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, out, lse = residuals
    dq, dk, dv, dsinks = _backward_call(
        VARLEN_BACKWARD_TARGET, (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k), sinks,
        attributes)
    # No cotangent for the integer cu_seqlens (None: a zero, which custom_vjp takes).
    return dq, dk, dv, None, None, dsinks


_attention_varlen.defvjp(_attention_varlen_forward, _attention_varlen_backward)
