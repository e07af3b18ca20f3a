"""Quantizers to the block-scaled formats of :mod:`ptxattn.blockscaled`, on the GPU and in NumPy.

Formats (all data and scales are uint8 arrays; CuPy has no FP8/FP4 dtypes):

MXFP8    e4m3 bytes, one UE8M0 scale byte (2^(byte - 127)) per 32 elements. The scale is the
         smallest power of two that keeps the block's amax within e4m3's 448, so nothing
         saturates; elements are rounded to nearest even.
NVFP4    e2m1 codes packed two per byte (element 2i in the low nibble), one UE4M3 scale byte per
         16 elements, and one FP32 scale per tensor: g = amax / (6 * 448), block scale
         = e4m3((amax_block / 6) / g), element = e2m1(x / (block_scale * g)), saturating at 6
         (a block with block_scale * g = 0 is all zeros).

Operand layouts (the scale blocks run along the axis the attention product contracts over):

Q, K     data (batch, seqlen, heads, head_dim) e4m3 or (..., head_dim / 2) packed e2m1;
         scales (batch, seqlen, heads, head_dim / 32) UE8M0 or (..., head_dim / 16) UE4M3.
V        MXFP8 along the sequence, stored transposed: data (batch, heads, head_dim, padded) and
         scales (batch, heads, head_dim, padded / 32), padded = seqlen rounded up to 128; the
         padding holds zeros.

``quantize_*`` run on CUDA arrays of bfloat16 or float16 (CuPy, torch, JAX: ptxattn.interop),
and return the caller's kind of array; ``encode_*`` / ``decode_*`` are the NumPy (ml_dtypes)
references, which produce the same bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from .. import runtime
from ..interop import CUDA_ARRAY, framework_arrays

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
SEQ_PAD = 128  # V's sequence is padded to whole kernel tiles
E4M3_MAX = 448.0
E2M1_MAX = 6.0

_SOURCE = "kernels/quantize.cu"
_ARCHS = ("sm_90a", "sm_120a")  # cvt to/from e4m3 needs sm_89+
_THREADS = 256


def variants() -> list[runtime.KernelSpec]:
    return [runtime.KernelSpec(f"quantize_{entry}", _SOURCE, entry, archs=_ARCHS)
            for entry in ("mxfp8_quantize_rows", "mxfp8_quantize_v", "tensor_amax",
                          "nvfp4_quantize_rows")]


def padded_seqlen(seqlen: int) -> int:
    return -(-seqlen // SEQ_PAD) * SEQ_PAD


# ---------------------------------------------------------------------------------------------
# NumPy references


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.shape[-1] % size:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of {size}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def _mxfp8_exponents(amax: np.ndarray) -> np.ndarray:
    """e of the scale 2^e: smallest with amax / 2^e <= 448; -127 for zero / FP32 subnormals."""
    bits = amax.astype(np.float32).view(np.uint32)
    biased = (bits >> 23).astype(np.int32)
    e = biased - 135 + ((bits & 0x7FFFFF) > 0x600000)
    return np.where(biased == 0, -127, np.maximum(e, -127))


def encode_mxfp8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MXFP8 along the last axis: (e4m3 bytes of x's shape, UE8M0 bytes (..., n / 32))."""
    blocks = _blocks(x, MXFP8_BLOCK)
    e = _mxfp8_exponents(np.abs(blocks).max(axis=-1))
    inverse = ((127 - e).astype(np.uint32) << 23).view(np.float32)  # 2^-e, exact
    scaled = blocks * inverse[..., None]
    codes = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes.reshape(np.shape(x)), (e + 127).astype(np.uint8)


def decode_ue8m0(scales: np.ndarray) -> np.ndarray:
    s = np.asarray(scales, dtype=np.uint8).astype(np.float32)
    return np.where(s == 255, np.nan, np.exp2(s - 127)).astype(np.float32)


def decode_mxfp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    values = np.asarray(codes, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK)
    return (blocks * decode_ue8m0(scales)[..., None]).reshape(values.shape)


def encode_mxfp8_v(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """V (batch, seqlen, heads, head_dim) to MXFP8 along the sequence, transposed and padded:
    (e4m3 (batch, heads, head_dim, padded), UE8M0 (batch, heads, head_dim, padded / 32))."""
    v = np.asarray(v, dtype=np.float32)
    batch, seqlen, heads, head_dim = v.shape
    vt = np.zeros((batch, heads, head_dim, padded_seqlen(seqlen)), np.float32)
    vt[..., :seqlen] = v.transpose(0, 2, 3, 1)
    return encode_mxfp8(vt)


def decode_mxfp8_v(vt: np.ndarray, scales: np.ndarray, seqlen: int) -> np.ndarray:
    """(batch, seqlen, heads, head_dim) float32 from encode_mxfp8_v's output."""
    return decode_mxfp8(vt, scales)[..., :seqlen].transpose(0, 3, 1, 2)


def nvfp4_tensor_scale(amax: float) -> np.float32:
    g = np.float32(amax) / np.float32(E2M1_MAX * E4M3_MAX)
    return np.float32(1.0) if g == 0 else g


def encode_nvfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """NVFP4 along the last axis: (packed e2m1 (..., n / 2), UE4M3 (..., n / 16), FP32 g)."""
    blocks = _blocks(x, NVFP4_BLOCK)
    g = nvfp4_tensor_scale(np.abs(blocks).max(initial=0.0))
    wanted = (np.abs(blocks).max(axis=-1) / np.float32(E2M1_MAX)) / g
    scale = np.minimum(wanted, np.float32(E4M3_MAX)).astype(ml_dtypes.float8_e4m3fn)
    denom = scale.astype(np.float32) * g
    safe = np.where(denom > 0, denom, np.float32(1.0))
    y = np.where(denom[..., None] > 0, blocks / safe[..., None], np.float32(0.0))
    codes = np.clip(y, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    out_shape = (*np.shape(x)[:-1], np.shape(x)[-1] // 2)
    return packed.reshape(out_shape).astype(np.uint8), scale.view(np.uint8), g


def decode_ue4m3(scales: np.ndarray) -> np.ndarray:
    return (np.asarray(scales, np.uint8) & 0x7F).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def decode_nvfp4(packed: np.ndarray, scales: np.ndarray, tensor_scale: float) -> np.ndarray:
    packed = np.asarray(packed, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    blocks = values.reshape(*values.shape[:-1], values.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    scaled = blocks * (decode_ue4m3(scales) * np.float32(tensor_scale))[..., None]
    return scaled.reshape(values.shape)


# ---------------------------------------------------------------------------------------------
# GPU quantizers


def _check_input(name: str, x, ndim: int | None = None):
    import cupy

    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"{name} must be {CUDA_ARRAY}, got {type(x).__module__}."
                        f"{type(x).__name__}")
    if str(x.dtype) not in ("bfloat16", "float16"):
        raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {x.shape}")
    return cupy.ascontiguousarray(x), np.int32(str(x.dtype) == "bfloat16")


def _launch(entry: str, grid, args) -> None:
    spec = next(s for s in variants() if s.entry == entry)
    runtime.launch(runtime.load(spec), grid, (_THREADS,), args)


@framework_arrays
def quantize_mxfp8(x):
    """MXFP8 of x along its last axis (for Q and K: head_dim), on the GPU.

    Each block of 32 elements gets a UE8M0 scale, the smallest power of two that keeps the
    block's amax within e4m3's 448 (nothing saturates); elements are rounded to nearest even.
    Kinds of array as in ``ptxattn.attention``.

    Parameters
    ----------
    x : CUDA array
        bfloat16 or float16, any shape, its last axis a multiple of 32.

    Returns
    -------
    data : array
        uint8 e4m3 bytes of x's shape.
    scales : array
        uint8 UE8M0 (2^(byte - 127)), shape (..., n / 32).

    Raises
    ------
    TypeError
        x not a CUDA array, or not bfloat16 or float16.
    ValueError
        The last axis not a multiple of 32.

    Examples
    --------
    >>> import cupy
    >>> from ptxattn.blockscaled import quantize_mxfp8
    >>> q = cupy.random.standard_normal((2, 1024, 16, 128)).astype("bfloat16")
    >>> data, scales = quantize_mxfp8(q)
    >>> data.shape, scales.shape
    ((2, 1024, 16, 128), (2, 1024, 16, 4))
    """
    import cupy

    x, is_bf16 = _check_input("x", x)
    if x.shape[-1] % MXFP8_BLOCK:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of {MXFP8_BLOCK}")
    data = cupy.empty(x.shape, cupy.uint8)
    scales = cupy.empty((*x.shape[:-1], x.shape[-1] // MXFP8_BLOCK), cupy.uint8)
    n_blocks = x.size // MXFP8_BLOCK
    if n_blocks:
        _launch("mxfp8_quantize_rows", (-(-n_blocks // _THREADS),),
                [x, data, scales, np.int64(n_blocks), is_bf16])
    return data, scales


@framework_arrays
def quantize_mxfp8_v(v):
    """MXFP8 of V along the sequence, in the transposed, padded layout the kernel reads.

    The scale blocks run along the keys, the axis P V contracts over: one UE8M0 scale per 32
    keys of each head_dim column. Kinds of array as in ``ptxattn.attention``.

    Parameters
    ----------
    v : CUDA array
        bfloat16 or float16 (batch, seqlen, heads, head_dim).

    Returns
    -------
    data : array
        uint8 e4m3 (batch, heads, head_dim, padded), padded = seqlen rounded up to 128, zeros
        past seqlen.
    scales : array
        uint8 UE8M0 (batch, heads, head_dim, padded / 32).

    Raises
    ------
    TypeError
        v not a CUDA array, or not bfloat16 or float16.
    ValueError
        v not 4-d; batch or padded / 32 above 65535 (the quantizer's grid).

    Examples
    --------
    >>> from ptxattn.blockscaled import quantize_mxfp8_v
    >>> v = cupy.random.standard_normal((2, 1000, 16, 128)).astype("bfloat16")
    >>> data, scales = quantize_mxfp8_v(v)
    >>> data.shape, scales.shape
    ((2, 16, 128, 1024), (2, 16, 128, 32))
    """
    import cupy

    v, is_bf16 = _check_input("v", v, ndim=4)
    batch, seqlen, heads, head_dim = v.shape
    padded = padded_seqlen(seqlen)
    if padded // MXFP8_BLOCK > 65535 or batch > 65535:
        raise ValueError(f"v of shape {v.shape} is too large for the quantizer's grid")
    vt = cupy.empty((batch, heads, head_dim, padded), cupy.uint8)
    scales = cupy.empty((batch, heads, head_dim, padded // MXFP8_BLOCK), cupy.uint8)
    if v.size:
        grid = (-(-heads * head_dim // _THREADS), padded // MXFP8_BLOCK, batch)
        _launch("mxfp8_quantize_v", grid,
                [v, vt, scales, np.int32(seqlen), np.int32(heads), np.int32(head_dim),
                 np.int32(padded), is_bf16])
    return vt, scales


@framework_arrays
def quantize_nvfp4(x):
    """NVFP4 of x along its last axis (for Q and K: head_dim), on the GPU.

    With g = amax / (6 * 448) over the whole tensor (1 for an all-zero tensor), each block of
    16 elements gets the UE4M3 scale e4m3((amax_block / 6) / g), and each element becomes
    e2m1(x / (block_scale * g)), saturating at 6 (a block whose block_scale * g is 0 is all
    zeros). Kinds of array as in ``ptxattn.attention``.

    Parameters
    ----------
    x : CUDA array
        bfloat16 or float16, any shape, its last axis a multiple of 16.

    Returns
    -------
    data : array
        uint8 e2m1 codes packed two a byte, element 2i in the low nibble: (..., n / 2).
    scales : array
        uint8 UE4M3, (..., n / 16).
    tensor_scale : array
        float32 (1,), g: pass it as ``q_tensor_scale`` or ``k_tensor_scale``.

    Raises
    ------
    TypeError
        x not a CUDA array, or not bfloat16 or float16.
    ValueError
        The last axis not a multiple of 16.

    Examples
    --------
    >>> from ptxattn.blockscaled import quantize_nvfp4
    >>> data, scales, tensor_scale = quantize_nvfp4(q)
    >>> data.shape, scales.shape, tensor_scale.shape
    ((2, 1024, 16, 64), (2, 1024, 16, 8), (1,))
    """
    import cupy

    x, is_bf16 = _check_input("x", x)
    if x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"the last axis ({x.shape[-1]}) must be a multiple of {NVFP4_BLOCK}")
    data = cupy.empty((*x.shape[:-1], x.shape[-1] // 2), cupy.uint8)
    scales = cupy.empty((*x.shape[:-1], x.shape[-1] // NVFP4_BLOCK), cupy.uint8)
    tensor_scale = cupy.ones((1,), cupy.float32)
    n_blocks = x.size // NVFP4_BLOCK
    if n_blocks:
        amax_bits = cupy.zeros((1,), cupy.uint32)
        blocks = min(-(-x.size // (8 * _THREADS)), 4096)
        _launch("tensor_amax", (blocks,), [x, np.int64(x.size), is_bf16, amax_bits])
        _launch("nvfp4_quantize_rows", (-(-n_blocks // _THREADS),),
                [x, data, scales, amax_bits, tensor_scale, np.int64(n_blocks), is_bf16])
    return data, scales, tensor_scale


def quantize_qkv(q, k, v, format: str = "mxfp8") -> dict:  # noqa: A002 - the API's word
    """Quantizes q, k, v for ``blockscaled_attention(**quantize_qkv(q, k, v, format), ...)``.

    Q and K in ``format`` along head_dim (``quantize_mxfp8`` or ``quantize_nvfp4``), V in MXFP8
    along the sequence either way (``quantize_mxfp8_v``).

    Parameters
    ----------
    q, k, v : CUDA array
        bfloat16 or float16 (batch, seqlen, heads, head_dim).
    format : {'mxfp8', 'nvfp4'}, default 'mxfp8'
        The format of q and k.

    Returns
    -------
    dict
        The keyword arguments of ``blockscaled_attention``: "q", "k", "v", "q_scale",
        "k_scale", "v_scale", "format" and, for NVFP4, "q_tensor_scale" and "k_tensor_scale".

    Raises
    ------
    ValueError
        An unknown ``format``, or as the quantizers raise it.
    TypeError
        As the quantizers raise it.

    Examples
    --------
    >>> import cupy
    >>> from ptxattn.blockscaled import blockscaled_attention, quantize_qkv
    >>> q, k, v = (cupy.random.standard_normal((2, 1024, 16, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> operands = quantize_qkv(q, k, v, "mxfp8")
    >>> sorted(operands)
    ['format', 'k', 'k_scale', 'q', 'q_scale', 'v', 'v_scale']
    >>> out, lse = blockscaled_attention(**operands, causal=True)
    """
    if format == "mxfp8":
        (qd, qs), (kd, ks) = quantize_mxfp8(q), quantize_mxfp8(k)
        extra = {}
    elif format == "nvfp4":
        (qd, qs, qg), (kd, ks, kg) = quantize_nvfp4(q), quantize_nvfp4(k)
        extra = {"q_tensor_scale": qg, "k_tensor_scale": kg}
    else:
        raise ValueError(f"format must be 'mxfp8' or 'nvfp4', got {format!r}")
    vd, vs = quantize_mxfp8_v(v)
    return {"q": qd, "k": kd, "v": vd, "q_scale": qs, "k_scale": ks, "v_scale": vs,
            "format": format, **extra}
