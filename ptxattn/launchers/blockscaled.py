"""Launcher of the block-scaled attention kernel, ``ptx_src/kernels/fwd_blockscaled.cu``: its
native build on sm_120a/sm_121a (block-scaled mma.sync) and its exact emulation build on sm_90a
(ptx/block_scale_mma.cuh). The operand layouts are ptxattn.blockscaled's.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from .. import params, runtime

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


@dataclasses.dataclass(frozen=True)
class BlockScaledConfig:
    """The template arguments of ``attn_fwd_blockscaled`` (fwd_blockscaled.cu)."""

    head_dim: int
    nvfp4: bool


def kernel_spec(fmt: str, head_dim: int, emulate: bool) -> runtime.KernelSpec:
    build = "emulated" if emulate else "native"
    config = BlockScaledConfig(head_dim, fmt == "nvfp4")
    return runtime.KernelSpec(
        f"blockscaled_{fmt}_d{head_dim}_{build}", _SOURCE,
        f"ptxattn::attn_fwd_blockscaled<{runtime.template_arguments(config)}>",
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


def forward(problem, q, k, v, out, lse, *, q_scale, k_scale, v_scale, q_tensor_scale=None,
            k_tensor_scale=None) -> None:
    """Block-scaled attention of ``problem`` (AttentionProblem.from_blockscaled) into ``out``
    (bfloat16) and ``lse``, by the native build or, on sm_90a, the emulation build."""
    p = problem
    kernel = runtime.load(kernel_spec(p.format, p.head_dim,
                                      build_for_arch(runtime.device_arch()) == "emulated"))
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
        causal=int(p.causal), num_m_blocks=num_m_blocks, section_heads=1, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, q_tensor_scale=_device_scale(q_tensor_scale),
        k_tensor_scale=_device_scale(k_tensor_scale), v_scale_row=p.padded_seqlen_k // 32)
    (args.out_stride_b, args.out_stride_s, args.out_stride_h) = params.strides(out)
    (args.lse_stride_b, args.lse_stride_h) = params.strides(lse, 2)
    runtime.launch(kernel, (num_m_blocks * p.heads_q * p.batch,), (THREADS,), [args])
