"""The public entry point: validate the arguments, pick a kernel family, launch it."""

from __future__ import annotations

import importlib
import math
import numbers

# Kernel families by backend name: each module has variants(), HEAD_DIMS, ARCHS and forward().
BACKENDS = {"portable": "ptxattn.portable", "hopper": "ptxattn.hopper"}

_DTYPES = ("float16", "bfloat16")
# Every kernel moves rows of head_dim in 16-byte vectors (cp.async, TMA), so strides and base
# addresses must be multiples of 16 bytes.
_ALIGN_BYTES = 16


def backend_module(name: str):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)} or None, got {name!r}")
    return importlib.import_module(BACKENDS[name])


def default_backend(arch: str) -> str:
    return "hopper" if arch == "sm_90a" else "portable"


def require_cupy(**arrays) -> None:
    import cupy

    for name, x in arrays.items():
        if x is not None and not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, got {type(x).__module__}."
                            f"{type(x).__name__}")


def _check_tensor(name: str, x) -> None:
    check_layout(name, x)
    if str(x.dtype) not in _DTYPES:
        raise TypeError(f"{name} must have dtype float16 or bfloat16, got {x.dtype}")


def check_layout(name: str, x) -> None:
    """A 4-d (batch, seqlen, heads, head_dim) array the kernels can read in 16-byte vectors."""
    if x.ndim != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, seqlen, heads, head_dim), "
                         f"got shape {x.shape}")
    if x.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {x.shape}")
    if x.strides[-1] != x.itemsize:
        raise ValueError(f"{name} must have unit stride in head_dim, got strides {x.strides} "
                         f"(bytes) for shape {x.shape}")
    if x.data.ptr % _ALIGN_BYTES or any(s % _ALIGN_BYTES for s in x.strides[:-1]):
        raise ValueError(f"{name} must have a 16-byte aligned base and batch/seqlen/heads strides "
                         f"that are multiples of 16 bytes, got strides {x.strides}")


def check_qkv_shapes(q, k, v) -> None:
    """What every attention entry point needs of q, k, v (batch, seqlen, heads, head_dim): one
    device, k and v alike, batch and head_dim matching q's, q's heads a multiple of k's."""
    devices = {x.device.id for x in (q, k, v)}
    if len(devices) != 1:
        raise ValueError(f"q, k and v must be on one device, got devices {sorted(devices)}")
    batch, _, heads_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.shape[0] != batch:
        raise ValueError(f"k must have batch {batch} like q, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have head_dim {head_dim} like q, got {k.shape[3]}")
    if heads_q % k.shape[2]:
        raise ValueError(f"q's heads ({heads_q}) must be a multiple of k/v's heads ({k.shape[2]})")


def validate(q, k, v, out, softmax_scale):
    """Checks everything the kernels assume of the arrays' metadata (shape, dtype, strides,
    device); returns the softmax scale to use. Reads no array data, so it needs no GPU."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_qkv_shapes(q, k, v)
    head_dim = q.shape[3]
    if out is not None:
        _check_tensor("out", out)
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(f"out must have q's shape {q.shape} and dtype {q.dtype}, got "
                             f"{out.shape} and {out.dtype}")
        if out.device.id != q.device.id:
            raise ValueError(f"out must be on q's device {q.device.id}, got {out.device.id}")
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite positive number or None, "
                         f"got {softmax_scale!r}")
    return float(softmax_scale)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, out=None, backend: str | None = None):
    """Scaled dot-product attention forward, ``softmax(scale * q k^T) v``.

    q: (batch, seqlen_q, heads_q, head_dim); k, v: (batch, seqlen_k, heads_kv, head_dim), CuPy
    arrays of float16 or bfloat16 with unit stride in head_dim (other strides are free). heads_q
    must be a multiple of heads_kv (GQA/MQA). ``causal`` masks key j from query i unless
    j <= i + seqlen_k - seqlen_q (bottom-right aligned); rows that see no key give 0.
    ``softmax_scale`` defaults to 1/sqrt(head_dim). Returns the output in q's dtype (written into
    ``out`` if given) and, with ``return_lse``, the float32 log-sum-exp of shape
    (batch, heads_q, seqlen_q) in natural log. ``backend`` picks a kernel family ('hopper',
    'portable'); by default the fastest one for the current GPU.
    """
    import cupy

    require_cupy(q=q, k=k, v=v, out=out)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = validate(q, k, v, out, softmax_scale)
    from .runtime import device_arch

    with cupy.cuda.Device(q.device.id):
        arch = device_arch()
        name = default_backend(arch) if backend is None else backend
        module = backend_module(name)
        if arch not in module.ARCHS:
            raise ValueError(f"backend {name!r} runs on {module.ARCHS}, not on this {arch} GPU")
        if q.shape[3] not in module.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {module.HEAD_DIMS} for backend {name!r}, "
                             f"got {q.shape[3]}")
        if out is None:
            out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=cupy.float32)
        module.forward(q, k, v, out, lse, causal=causal, softmax_scale=scale)
    return (out, lse) if return_lse else out
