"""Arrays of any framework in, the same framework's arrays out: zero-copy, on the caller's stream.

Every public entry point that takes CUDA arrays (``ptxattn.attention`` and the other top-level
functions, ``ptxattn.fp8.attention``, the quantizers, ``ptxattn.distributed.ring_attention``
and its backward) is decorated with ``framework_arrays``, so that its body sees CuPy arrays and
its caller gets back the kind of array it passed in. (The framework adapters ptxattn.torch and
ptxattn.jax call these entry points; the FP8 reference and the ring simulation take CuPy
arrays.)

In. A cupy.ndarray is used as it is. Anything else that exposes CUDA memory through
``__dlpack__`` (torch tensors, JAX arrays, ...) or ``__cuda_array_interface__`` (Numba, older
libraries) becomes a CuPy view of the same memory. No framework is imported to recognize its
arrays: the kind is read from the array's type (its module, or a base class's). Host arrays
(NumPy, CPU tensors) are refused with a TypeError naming the argument. torch's float8_e4m3fn
tensors, which CuPy's DLPack import does not know, come in as CuPy float8_e4m3fn views of their
bytes (what ptxattn.fp8 takes).

Out. Results come back as the kind of the call's first array argument: torch tensors through
``torch.from_dlpack``, JAX arrays through ``jax.dlpack.from_dlpack`` (both zero-copy), CuPy
arrays otherwise. A result that is one of the caller's own arrays (an ``out=`` buffer) is
returned as the caller's object itself. ptxattn.fp8's E4M3Array comes back to torch as a
float8_e4m3fn tensor, to JAX as it is (CuPy's DLPack import takes no FP8 from JAX either).

Streams. The kernels are queued on the caller's current stream, with no synchronization added:

- torch: torch's current stream on the tensors' device, made CuPy's current stream for the call.
  The inputs are exported with ``stream=-1`` ("the consumer orders the work itself"): the work
  goes on the stream torch's own next op would use, so it is already ordered after whatever
  produced them. (Naming the stream's handle instead would make torch record an event and have
  the stream wait on itself: torch compares streams by identity, and a stream wrapped from its
  handle is not the pool stream it came from.) Results go back through ``torch.from_dlpack``,
  which names torch's current stream, which is CuPy's current one: again no event.
- everything else: CuPy's current stream. DLPack producers are told it (``cupy.from_dlpack``
  names it) and order their pending work before it on the GPU, as JAX does; JAX results are
  handed over the same way in reverse. A ``__cuda_array_interface__`` producer that names a
  stream is waited for by CuPy on the host, as that protocol asks.

Memory the entry points allocate (outputs, workspaces) comes from CuPy's memory pool, on the
caller's stream; an output handed to torch returns to that pool when torch frees it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import numbers

import ml_dtypes

# DLPack device types whose memory CUDA kernels address.
DLPACK_CUDA = 2
DLPACK_CUDA_MANAGED = 13
_DLPACK_DEVICE_NAMES = {1: "host memory", 3: "pinned host memory", 4: "OpenCL memory",
                        7: "Vulkan memory", 8: "Metal memory", 10: "ROCm memory"}

CUDA_ARRAY = ("a CUDA array (a CuPy array, a torch tensor or JAX array on a CUDA device, or any "
              "array with __dlpack__ or __cuda_array_interface__ in GPU memory)")


def framework(x) -> str:
    """'torch' for torch tensors, 'jax' for JAX arrays, 'cupy' for anything else, read from the
    modules of the type and its bases (so subclasses count), without importing either framework."""
    for cls in type(x).__mro__:
        package = cls.__module__.partition(".")[0]
        if package == "torch":
            return "torch"
        if package in ("jax", "jaxlib"):
            return "jax"
    return "cupy"


def is_array(x) -> bool:
    """Whether ``x`` is an array that a Call converts or refuses, rather than a number, None, or
    an object the entry point checks itself (an fp8.E4M3Array, a rotation)."""
    return (hasattr(x, "__dlpack__") or hasattr(x, "__cuda_array_interface__")
            or hasattr(x, "__array__") or hasattr(x, "__array_interface__"))


def _type_name(x) -> str:
    return f"{type(x).__module__}.{type(x).__name__}"


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol, which cupy.cuda.Stream.from_external
    takes (whatever the torch version; torch's own streams have the protocol only lately)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@functools.lru_cache(maxsize=64)
def _cupy_stream(ptr: int):
    """A CuPy stream for the CUDA stream ``ptr`` (0: the legacy default stream); CuPy never
    destroys a stream it got this way."""
    import cupy
    return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


class Call:
    """One entry-point call: ``arguments`` (name -> value) with every array as a CuPy array, set
    up inside the caller's device and stream, and :meth:`returned` for the results.

    Values that are None, numbers, or no arrays pass through unchanged. Use it as a context
    manager and hand the results back inside it, while the caller's stream is CuPy's current one.
    """

    def __init__(self, arguments: dict):
        self._given = arguments
        self._lead_name, self._lead = next(
            ((name, x) for name, x in arguments.items() if is_array(x)), (None, None))
        self.kind = framework(self._lead) if self._lead is not None else "cupy"
        self._stack = contextlib.ExitStack()
        self._originals: dict[int, object] = {}
        self.arguments: dict = {}

    def __enter__(self) -> "Call":
        with self._stack:
            if self.kind == "torch" and self._lead.device.type == "cuda":
                self._enter_torch_stream(self._lead.device.index)
            self.arguments = {name: self._convert(name, x) for name, x in self._given.items()}
            self._stack = self._stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _enter_torch_stream(self, index: int) -> None:
        import cupy
        import torch

        self._stack.enter_context(torch.cuda.device(index))  # torch exports from its device only
        self._stack.enter_context(cupy.cuda.Device(index))
        self._stack.enter_context(_cupy_stream(torch.cuda.current_stream(index).cuda_stream))

    def _convert(self, name: str, x):
        import cupy

        if x is None or isinstance(x, (cupy.ndarray, numbers.Number)) or not is_array(x):
            return x
        if hasattr(x, "__dlpack__"):
            converted = self._from_dlpack(name, x)
        elif hasattr(x, "__cuda_array_interface__"):
            converted = cupy.asarray(x)
        else:
            raise TypeError(f"{name} must be {CUDA_ARRAY}, got {_type_name(x)} in host memory")
        self._originals[id(converted)] = x
        return converted

    def _from_dlpack(self, name: str, x):
        import cupy

        device_type, device_id = x.__dlpack_device__()
        if device_type not in (DLPACK_CUDA, DLPACK_CUDA_MANAGED):
            where = _DLPACK_DEVICE_NAMES.get(int(device_type), f"DLPack device {device_type}")
            raise TypeError(f"{name} must be {CUDA_ARRAY}, got {_type_name(x)} in {where}")
        if x is not self._lead and hasattr(self._lead, "__dlpack__"):
            lead_device = self._lead.__dlpack_device__()[1]
            if device_id != lead_device:
                raise ValueError(f"{name} must be on {self._lead_name}'s device {lead_device}, "
                                 f"got {device_id}")
        if framework(x) == "torch":
            return self._from_torch(name, x)
        return cupy.from_dlpack(x)

    def _from_torch(self, name: str, x):
        import cupy
        import torch

        if x.requires_grad:
            raise TypeError(f"{name} requires grad, and ptxattn's functions record no autograd: "
                            f"use ptxattn.torch for gradients, or pass {name}.detach()")
        fp8 = x.dtype == torch.float8_e4m3fn
        if fp8:
            x = x.view(torch.uint8)
        # In a torch call the kernels go on torch's current stream, after whatever produced x:
        # stream=-1 asks torch for no event (module docstring). In a call led by another kind of
        # array, CuPy's current stream is named and torch orders x's producers before it.
        converted = (cupy.from_dlpack(x.__dlpack__(stream=-1)) if self.kind == "torch"
                     else cupy.from_dlpack(x))
        return converted.view(ml_dtypes.float8_e4m3fn) if fp8 else converted

    def returned(self, result):
        """``result`` (an array, or a tuple, list or dict of arrays and other values) in the
        caller's kind of array."""
        if isinstance(result, (tuple, list)):
            return type(result)(self.returned(x) for x in result)
        if isinstance(result, dict):
            return {key: self.returned(x) for key, x in result.items()}
        original = self._originals.get(id(result))
        if original is not None:
            return original
        if self.kind == "torch":
            return _to_torch(result)
        if self.kind == "jax":
            return _to_jax(result)
        return result


def _to_torch(x):
    import cupy
    import torch

    if isinstance(x, cupy.ndarray):
        return torch.from_dlpack(x)
    if isinstance(getattr(x, "bytes", None), cupy.ndarray):  # an fp8.E4M3Array
        return torch.from_dlpack(x.bytes).view(torch.float8_e4m3fn)
    return x


def _to_jax(x):
    import cupy
    import jax.dlpack

    return jax.dlpack.from_dlpack(x) if isinstance(x, cupy.ndarray) else x


def framework_arrays(entry_point):
    """``entry_point`` for CUDA arrays of any framework: its array arguments reach it as CuPy
    arrays (a TypeError naming the argument for host arrays), its work goes on the caller's
    stream, and its results (arrays, or tuples, lists and dicts of them) go back as the kind of
    its first array argument (module docstring)."""
    positional = tuple(p.name for p in inspect.signature(entry_point).parameters.values()
                       if p.kind is p.POSITIONAL_OR_KEYWORD)

    @functools.wraps(entry_point)
    def called(*args, **kwargs):
        import cupy

        # CuPy callers (the common case) skip the conversion: about 6 us of Python per call
        if all(isinstance(x, cupy.ndarray) or not is_array(x)
               for x in (*args, *kwargs.values())):
            return entry_point(*args, **kwargs)
        if len(args) > len(positional):
            raise TypeError(f"{entry_point.__name__}() takes {len(positional)} positional "
                            f"arguments but {len(args)} were given")
        with Call({**dict(zip(positional, args)), **kwargs}) as call:
            return call.returned(entry_point(**call.arguments))

    return called
