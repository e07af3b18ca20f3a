"""Block-scaled attention forward: MXFP8 or NVFP4 Q/K, MXFP8 V, bf16 output and LSE.

    out, lse = blockscaled_attention(**quant.quantize_qkv(q, k, v, "nvfp4"), causal=True)

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
quantizers in :mod:`ptxattn.quant` produce exactly these layouts. Operands may be any framework's
CUDA arrays; the results come back as q's kind (ptxattn.interop).
"""

from __future__ import annotations

import math
import numbers
import warnings

from . import dispatch, params, runtime
from .interop import framework_arrays
from .problem import AttentionProblem

FORMATS = ("mxfp8", "nvfp4")
HEAD_DIMS = (64, 128)
BLOCK_M = 128
BLOCK_N = 128
STAGES = 2
THREADS = 256

_SOURCE = "kernels/fwd_blockscaled.cu"
_NATIVE_ARCHS = ("sm_120a", "sm_121a")  # consumer Blackwell: block-scaled mma.sync
_EMULATION_ARCH = "sm_90a"


def _row_bytes(fmt: str, head_dim: int) -> int:
    return head_dim // 2 if fmt == "nvfp4" else head_dim


def smem_bytes(fmt: str, head_dim: int) -> int:
    """Dynamic shared memory of one block: Q tile, STAGES x (K tile + V^T tile), 2 STAGES + 1
    mbarriers, and 1 KB to align the tiles to the swizzle pattern."""
    row = _row_bytes(fmt, head_dim)
    return BLOCK_M * row + STAGES * (BLOCK_N * row + head_dim * BLOCK_N) + 64 + 1024


def kernel_spec(fmt: str, head_dim: int, emulate: bool) -> runtime.KernelSpec:
    build = "emulated" if emulate else "native"
    nvfp4 = str(fmt == "nvfp4").lower()
    return runtime.KernelSpec(
        f"blockscaled_{fmt}_d{head_dim}_{build}", _SOURCE,
        f"ptxattn::attn_fwd_blockscaled<{head_dim}, {nvfp4}>",
        defines={"PTXATTN_EMULATE_BLOCK_SCALE": int(emulate)},
        smem_bytes=smem_bytes(fmt, head_dim),
        archs=(_EMULATION_ARCH,) if emulate else _NATIVE_ARCHS)


def variants() -> list[runtime.KernelSpec]:
    """Native sm_120a builds and their sm_90a emulation builds."""
    return [kernel_spec(fmt, d, emulate) for emulate in (False, True) for fmt in FORMATS
            for d in HEAD_DIMS]


def build_for_arch(arch: str) -> str:
    """'native' on sm_120a/sm_121a, 'emulated' on sm_90a; other GPUs cannot run block-scaled
    attention."""
    if arch in _NATIVE_ARCHS:
        return "native"
    if arch == _EMULATION_ARCH:
        return "emulated"
    raise RuntimeError(f"block-scaled attention runs on sm_120a/sm_121a (native) or sm_90a (emulated), "
                       f"not on this {arch} GPU")


def _device_scale(value):
    import cupy

    if value is None:
        return cupy.ones((1,), cupy.float32)
    if isinstance(value, numbers.Real):
        return cupy.full((1,), value, cupy.float32)
    return value.reshape(1)


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
    # Refuses a GPU or head_dim that no block-scaled build runs, before anything is allocated;
    # the launch below picks the native or emulation build itself.
    dispatch.select(runtime.device_arch(p.device), p.format, p.head_dim, features=p.features)
    with cupy.cuda.Device(q.device.id):
        build = build_for_arch(runtime.device_arch())
        if build == "emulated":
            warnings.warn("ptxattn.blockscaled_attention: this GPU has no block-scaled MMA, so "
                          "it runs the sm_90a emulation build (correct, not fast)",
                          RuntimeWarning, stacklevel=2)
        kernel = runtime.load(kernel_spec(p.format, p.head_dim, build == "emulated"))
        if out is None:
            out = cupy.empty((p.batch, p.seqlen_q, p.heads_q, p.head_dim), "bfloat16")
        lse = cupy.empty((p.batch, p.heads_q, p.seqlen_q), cupy.float32)
        row = _row_bytes(p.format, p.head_dim)
        q_map = runtime.tensor_map(q, (1, BLOCK_M, 1, row), swizzle=row)
        k_map = runtime.tensor_map(k, (1, BLOCK_N, 1, row), swizzle=row)
        # Keys past Sk are zero-filled by the TMA, whatever the padding holds.
        v_map = runtime.tensor_map(v[..., :p.seqlen_k], (1, 1, p.head_dim, BLOCK_N), swizzle=128)
        num_m_blocks = -(-p.seqlen_q // BLOCK_M)
        args = params.FwdParams(
            q_map=q_map, k_map=k_map, v_map=v_map, out=out, lse=lse, batch=p.batch,
            seqlen_q=p.seqlen_q, seqlen_k=p.seqlen_k, heads_q=p.heads_q, heads_kv=p.heads_kv,
            q_per_kv=p.heads_q // p.heads_kv, scale_log2=p.softmax_scale * math.log2(math.e),
            causal=int(causal), num_m_blocks=num_m_blocks, section_heads=1, q_scale=q_scale,
            k_scale=k_scale, v_scale=v_scale, q_tensor_scale=_device_scale(q_tensor_scale),
            k_tensor_scale=_device_scale(k_tensor_scale), v_scale_row=p.padded_seqlen_k // 32)
        (args.out_stride_b, args.out_stride_s, args.out_stride_h) = params.strides(out)
        (args.lse_stride_b, args.lse_stride_h) = params.strides(lse, 2)
        runtime.launch(kernel, (num_m_blocks * p.heads_q * p.batch,), (THREADS,), [args])
    return out, lse
