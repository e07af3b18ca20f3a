"""Block-scaled attention forward: MXFP8 or NVFP4 Q/K, MXFP8 V, bf16 output and LSE.

``blockscaled_attention`` is also exported as ``ptxattn.blockscaled_attention``;
docs/guide/blockscaled.md is the guide:

    from ptxattn.blockscaled import blockscaled_attention, quantize_qkv
    out, lse = blockscaled_attention(**quantize_qkv(q, k, v, "nvfp4"), causal=True)

On sm_120a and sm_121a this runs the native build of ptx_src/kernels/fwd_blockscaled.cu
(block-scaled mma.sync). On Hopper (sm_90a), which has no block-scaled MMA, it runs the same
kernel built with the exact emulation of each block-scaled MMA (ptx_src/ptx/block_scale_mma.cuh):
correct, not fast, and it warns.

Operands (all uint8, C-contiguous, on one device; B batch, Sq / Sk sequence lengths, Hq / Hkv
heads with Hq % Hkv == 0, D head_dim in {64, 128}, P = Sk rounded up to 128):

| operand | format='mxfp8' | format='nvfp4' |
|---|---|---|
| q | (B, Sq, Hq, D) e4m3 | (B, Sq, Hq, D/2) e2m1 pairs, low nibble first |
| q_scale | (B, Sq, Hq, D/32) UE8M0 | (B, Sq, Hq, D/16) UE4M3 |
| k | (B, Sk, Hkv, D) e4m3 | (B, Sk, Hkv, D/2) e2m1 pairs |
| k_scale | (B, Sk, Hkv, D/32) UE8M0 | (B, Sk, Hkv, D/16) UE4M3 |
| v | (B, Hkv, D, P) e4m3: V transposed, keys innermost, zeros past Sk | the same |
| v_scale | (B, Hkv, D, P/32) UE8M0: one scale per 32 keys of each head_dim column | the same |

NVFP4 also takes ``q_tensor_scale`` and ``k_tensor_scale``, the per-tensor FP32 scales (a float
or a 1-element float32 CUDA array). A value is data * block scale (* tensor scale). The
quantizers here (``quantize_qkv``, ``quantize_mxfp8``, ``quantize_mxfp8_v``, ``quantize_nvfp4``,
from ptxattn/quant/blockscaled.py, which also holds NumPy references of the formats) produce
exactly these layouts. Operands may be any framework's CUDA arrays; the results come back as
q's kind (ptxattn/interop.py).
"""

from __future__ import annotations

import warnings

from . import dispatch, runtime
from .interop import framework_arrays
from .problem import AttentionProblem
from .quant.blockscaled import quantize_mxfp8, quantize_mxfp8_v, quantize_nvfp4, quantize_qkv

__all__ = ["blockscaled_attention", "quantize_qkv", "quantize_mxfp8", "quantize_mxfp8_v",
           "quantize_nvfp4"]


def __dir__():
    return sorted(__all__)


@framework_arrays
def blockscaled_attention(q, k, v, q_scale, k_scale, v_scale, *,
                          format: str = "mxfp8",  # noqa: A002 - the API's word
                          causal: bool = False, softmax_scale: float | None = None,
                          q_tensor_scale=None, k_tensor_scale=None, out=None):
    """Attention forward, ``softmax(softmax_scale * Q K^T) V``, on block-scaled operands.

    The operands' layouts are the module docstring's table (``quantize_qkv`` makes them).
    Kinds of array and streams as in ``ptxattn.attention``. On sm_90a, which has no
    block-scaled MMA, the emulation build runs (correct, not fast) and a RuntimeWarning says
    so.

    Parameters
    ----------
    q, k, v : CUDA array
        uint8 data, C-contiguous, 16-byte aligned: q (B, Sq, Hq, D) e4m3 or (B, Sq, Hq, D/2)
        packed e2m1, k likewise with (B, Sk, Hkv, ...), v MXFP8 e4m3 transposed (B, Hkv, D,
        P). D is 64 or 128; Hq a multiple of Hkv.
    q_scale, k_scale, v_scale : CUDA array
        uint8 block scales, C-contiguous, 16-byte aligned: UE8M0 one per 32 of head_dim
        (MXFP8) or UE4M3 one per 16 (NVFP4) for q and k; v_scale UE8M0 (B, Hkv, D, P/32).
    format : {'mxfp8', 'nvfp4'}, default 'mxfp8'
        The format of q and k (v is MXFP8 either way).
    causal : bool, default False
        Masks key j from query i unless j <= i + Sk - Sq (bottom-right aligned); rows that see
        no key give 0 and LSE -inf.
    softmax_scale : float, optional
        The scale of the scores, finite and positive; 1 / sqrt(head_dim) by default.
    q_tensor_scale, k_tensor_scale : float or CUDA array, optional
        NVFP4 only, and required there: the per-tensor FP32 scales, a finite positive float or
        a 1-element float32 array on q's device (``quantize_nvfp4`` returns one).
    out : CUDA array, optional
        The buffer to write the output into: bfloat16 (B, Sq, Hq, D), C-contiguous, on q's
        device, its memory apart from every input's.

    Returns
    -------
    out : array
        bfloat16 (B, Sq, Hq, D): ``out`` itself if given.
    lse : array
        float32 (B, Hq, Sq), the natural log of each row's sum of exp(softmax_scale * q.k).

    Raises
    ------
    TypeError
        An operand not uint8, or in host memory; a tensor scale neither a number nor a
        1-element float32 array; ``out`` not bfloat16; ``causal`` not a bool.
    ValueError
        An unknown ``format``; an operand not 4-d, of another shape than the table's, not
        C-contiguous, not 16-byte aligned, or on another device; head_dim not 64 or 128; an
        empty problem; Hq not a multiple of Hkv; a tensor scale missing for NVFP4, given for
        MXFP8 or not positive; ``out`` of the wrong shape, not C-contiguous or overlapping an
        input; a bad ``softmax_scale``; a GPU that runs no block-scaled build.

    Warns
    -----
    RuntimeWarning
        On sm_90a, where the emulation build runs.

    Examples
    --------
    >>> import cupy
    >>> from ptxattn.blockscaled import blockscaled_attention, quantize_qkv
    >>> q, k, v = (cupy.random.standard_normal((2, 1024, 16, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> out, lse = blockscaled_attention(**quantize_qkv(q, k, v, "nvfp4"), causal=True)
    >>> out.shape, out.dtype, lse.shape
    ((2, 1024, 16, 128), dtype(bfloat16), (2, 16, 1024))
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
        dispatch.forward(route, p, q, k, v, out, lse, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, q_tensor_scale=q_tensor_scale,
                         k_tensor_scale=k_tensor_scale)
    return out, lse
