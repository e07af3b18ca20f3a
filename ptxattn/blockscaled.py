"""Block-scaled attention forward: MXFP8 or NVFP4 Q/K, MXFP8 V, bf16 output and LSE.

    from ptxattn.blockscaled import blockscaled_attention, quantize_qkv
    out, lse = blockscaled_attention(**quantize_qkv(q, k, v, "nvfp4"), causal=True)

On sm_120a this runs the native build of ptx_src/kernels/fwd_blockscaled.cu (block-scaled mma.sync).
On Hopper (sm_90a), which has no block-scaled MMA, it runs the same kernel built with the exact
emulation of each block-scaled MMA (block_scale_mma.cuh): correct, not fast, and it warns.

Operands (all uint8, C-contiguous, on one device; B batch, Sq / Sk sequence lengths, Hq / Hkv
heads with Hq % Hkv == 0, D head_dim in {64, 128}, P = Sk rounded up to 128):

=========  ===========================  ==============================================
operand    format='mxfp8'               format='nvfp4'
=========  ===========================  ==============================================
q          (B, Sq, Hq, D) e4m3          (B, Sq, Hq, D/2) e2m1 pairs, low nibble first
q_scale    (B, Sq, Hq, D/32) UE8M0      (B, Sq, Hq, D/16) UE4M3
k          (B, Sk, Hkv, D) e4m3         (B, Sk, Hkv, D/2) e2m1 pairs
k_scale    (B, Sk, Hkv, D/32) UE8M0     (B, Sk, Hkv, D/16) UE4M3
v          (B, Hkv, D, P) e4m3: V transposed, keys innermost, zeros past Sk
v_scale    (B, Hkv, D, P/32) UE8M0: one scale per 32 keys of each head_dim column
=========  ===========================  ==============================================

NVFP4 also takes ``q_tensor_scale`` and ``k_tensor_scale``, the per-tensor FP32 scales (a float
or a 1-element float32 CUDA array). A value is data * block scale (* tensor scale). The
quantizers here (:func:`quantize_qkv`, :func:`quantize_mxfp8`, :func:`quantize_mxfp8_v`,
:func:`quantize_nvfp4`, from ptxattn.quant.blockscaled) produce exactly these layouts. Operands may be any framework's
CUDA arrays; the results come back as q's kind (ptxattn.interop).
"""

from __future__ import annotations

import warnings

from . import dispatch, runtime
from .interop import framework_arrays
from .problem import AttentionProblem
from .quant.blockscaled import quantize_mxfp8, quantize_mxfp8_v, quantize_nvfp4, quantize_qkv

__all__ = ["blockscaled_attention", "quantize_qkv", "quantize_mxfp8", "quantize_mxfp8_v",
           "quantize_nvfp4"]

@framework_arrays
def blockscaled_attention(q, k, v, q_scale, k_scale, v_scale, *,
                          format: str = "mxfp8",  # noqa: A002 - the API's word
                          causal: bool = False, softmax_scale: float | None = None,
                          q_tensor_scale=None, k_tensor_scale=None, out=None):
    """softmax(softmax_scale * Q K^T) V on block-scaled operands (layouts: module docstring).

    ``causal`` masks key j from query i unless j <= i + Sk - Sq (bottom-right aligned); rows
    that see no key give 0 and LSE -inf. ``softmax_scale`` defaults to 1/sqrt(head_dim).
    Returns (out, lse): out bfloat16 (B, Sq, Hq, D) (written into ``out`` if given), lse float32
    (B, Hq, Sq), the natural log of each row's sum of exp(softmax_scale * q.k).
    """
    import cupy

    p = AttentionProblem.from_blockscaled(
        q, k, v, q_scale, k_scale, v_scale, format=format, q_tensor_scale=q_tensor_scale,
        k_tensor_scale=k_tensor_scale, causal=causal, softmax_scale=softmax_scale, out=out)
    # Refuses a GPU or head_dim that no block-scaled build runs, before anything is allocated.
    arch = runtime.device_arch(p.device)
    route = dispatch.select(arch, p.format, p.head_dim, features=p.features)
    if route.emulated:
        warnings.warn("ptxattn.blockscaled_attention: this GPU has no block-scaled MMA, so it "
                      "runs the sm_90a emulation build (correct, not fast)", RuntimeWarning,
                      stacklevel=2)
    with cupy.cuda.Device(p.device):
        if out is None:
            out = cupy.empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim), "bfloat16")
        lse = cupy.empty((p.batch, p.heads_q, p.seqlen_q), cupy.float32)
        dispatch.forward(arch, p, q, k, v, out, lse, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, q_tensor_scale=q_tensor_scale,
                         k_tensor_scale=k_tensor_scale)
    return out, lse
