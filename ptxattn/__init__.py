"""ptxattn: FlashAttention kernels for NVIDIA GPUs (forward, backward and serving), written in
CUDA with inline PTX and compiled at run time by NVRTC.

Entry points: :func:`attention` and :func:`attention_backward` (16-bit, fixed length),
:func:`attention_varlen` and :func:`attention_varlen_backward` (packed batches),
:func:`attention_with_kvcache`, :func:`attention_mla_decode` and :func:`merge_attention_states`
(serving), :func:`fp8_attention` (e4m3, Hopper) and :func:`blockscaled_attention` (MXFP8 /
NVFP4). The modules ``ptxattn.fp8``, ``ptxattn.blockscaled``, ``ptxattn.distributed``,
``ptxattn.torch`` and ``ptxattn.jax`` hold the rest of the public API.
"""

import ml_dtypes  # noqa: F401  registers the bfloat16 (and FP8) dtypes with NumPy, hence CuPy

from .runtime import CompileError, CudaError, PtxattnError

__version__ = "0.1.0"

# Each entry point's module: the entry points import CuPy, so they load on first use, and
# `import ptxattn` (and `python -m ptxattn kernels`) stays light.
_ENTRY_POINTS = {
    "attention": ("api", "attention"),
    "attention_backward": ("api", "attention_backward"),
    "attention_varlen": ("serving", "attention_varlen"),
    "attention_varlen_backward": ("serving", "attention_varlen_backward"),
    "attention_with_kvcache": ("serving", "attention_with_kvcache"),
    "attention_mla_decode": ("serving", "attention_mla_decode"),
    "merge_attention_states": ("serving", "merge_attention_states"),
    "fp8_attention": ("fp8", "attention"),
    "blockscaled_attention": ("blockscaled", "blockscaled_attention"),
}

__all__ = [*_ENTRY_POINTS, "CompileError", "CudaError", "PtxattnError", "__version__"]


def __getattr__(name):
    if name in _ENTRY_POINTS:
        import importlib
        module, attribute = _ENTRY_POINTS[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    raise AttributeError(f"module 'ptxattn' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
