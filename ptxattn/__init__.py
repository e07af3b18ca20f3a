"""ptxattn: FlashAttention forward kernels in handwritten CUDA + inline PTX, compiled by NVRTC."""

import ml_dtypes  # noqa: F401  registers the bfloat16 (and FP8) dtypes with NumPy, hence CuPy

from .runtime import CompileError, CudaError, PtxattnError

__version__ = "0.1.0"

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_with_kvcache",
           "merge_attention_states", "fp8_attention", "blockscaled_attention", "CompileError",
           "CudaError", "PtxattnError", "__version__"]
_SERVING = ("attention_varlen", "attention_with_kvcache", "merge_attention_states")


def __getattr__(name):
    # The API imports CuPy; keep `import ptxattn` (and `python -m ptxattn.kernels`) light.
    if name == "attention":
        from .api import attention
        return attention
    if name == "attention_backward":
        from .api import attention_backward
        return attention_backward
    if name in _SERVING:
        from . import serving
        return getattr(serving, name)
    if name == "fp8_attention":
        from .fp8 import attention as fp8_attention
        return fp8_attention
    if name == "blockscaled_attention":
        from .blockscaled import blockscaled_attention
        return blockscaled_attention
    raise AttributeError(f"module 'ptxattn' has no attribute {name!r}")
