"""ptxattn for PyTorch: attention as torch.library custom ops, traceable by torch.compile;
fixed-length and variable-length attention differentiable (in q, k, v and sinks) through
ptxattn's backward, FP8 attention (e4m3 inside, 16-bit tensors in and out) through the FP8
backward, the KV-cache entry point forward only. Imported only as ``ptxattn.torch``.

    import ptxattn.torch
    out = ptxattn.torch.attention(q, k, v, causal=True)   # CUDA tensors (batch, seqlen, heads, dim)
    out.float().square().mean().backward()                 # q.grad, k.grad, v.grad
    out = ptxattn.torch.attention(q, k, v, causal=True, window=(256, 0), sinks=sinks)  # sinks.grad
    out = ptxattn.torch.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len,
                                         causal=True)      # packed sequences, differentiable
    out = ptxattn.torch.fp8_attention(q, k, v, causal=True)  # e4m3 inside, differentiable
    out = ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               k_new=k, v_new=v)   # appends k, v to the cache
    out = ptxattn.torch.ring_attention(q, k, v, group=group, causal=True)  # context parallel

The ops:

- ``ptxattn::attention_fwd(q, k, v, causal, softmax_scale, window, softcap, sinks,
  deterministic, backend) -> (out, lse)``
- ``ptxattn::attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, window, softcap,
  sinks, deterministic, backend) -> (dq, dk, dv, dsinks)``
- ``ptxattn::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window, softcap, sinks, deterministic, check_contents,
  backend) -> (out, lse)``
- ``ptxattn::attention_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap, sinks, deterministic,
  check_contents, backend) -> (dq, dk, dv, dsinks)``
- ``ptxattn::fp8_attention_fwd(q, k, v, causal, softmax_scale, granularity, rotate, seed,
  deterministic) -> (out, lse, q8, k8, v8, q_descale, k_descale, v_descale)``: q, k, v
  quantized (``ptxattn.fp8.quantize_qkv`` with the recipe's fields), then
  ``ptxattn.fp8.attention``; q8, k8, v8 float8_e4m3fn, their descales float32.
- ``ptxattn::fp8_attention_bwd(dout, q8, k8, v8, out, lse, q_descale, k_descale, v_descale,
  causal, softmax_scale, rotate, seed, deterministic) -> (dq, dk, dv)``: with ``rotate``, dq and
  dk rotated back by R^T (R drawn from ``seed`` again).
- ``ptxattn::attention_with_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, uniform_cache_seqlen,
  block_table, k_new, v_new, causal, window, softcap, sinks, softmax_scale, num_splits,
  check_contents, backend, k_descale, v_descale) -> (out, lse)``, which mutates k_cache and
  v_cache (declared, so that torch.compile orders it and the caller sees the appended rows; they
  change only when k_new and v_new are given).
- ``ptxattn::attention_mla_decode_fwd(q, kv_cache, cache_seqlens, uniform_cache_seqlen,
  block_table, kv_new, kv_descale, softmax_scale, causal, num_splits, check_contents) -> (out,
  lse)``, which mutates kv_cache likewise.

Each has a fake implementation (shapes and dtypes only, the strides the real one gives), so that
torch.compile traces it without running it. attention's, attention_varlen's and fp8_attention's
pairs are joined by ``register_autograd``: each forward takes every argument its backward needs
(deterministic too), and torch.compile traces forward and backward into one graph. The FP8
forward returns what its backward reads, the e4m3 inputs and their descales, which autograd
saves in place of the 16-bit q, k, v (half their bytes); only its out carries a gradient, with
respect to the dequantized inputs (the quantizers are passed through as the identity). A
backward op's dsinks is the float32 (heads_q,) gradient of the sinks, or, for a call without
sinks, a tensor of shape (0,): an op's tuple of tensors holds no None, and the autograd formula
maps that stand-in back to None. attention_with_kvcache has no backward yet and no autograd
formula: it runs on tensors that require grad, but a backward through it raises torch's "no
autograd formula was registered" error (at compile time under torch.compile, which traces the
backward with the forward), never a silent zero gradient. (torch.library refuses an autograd
formula for an op that mutates its inputs, so its backward, when there is one, will be a
functional op of its own.) Every op runs on torch's current stream. Outputs are allocated by
torch's caching allocator, except the KV cache op's lse and the FP8 forward's lse, e4m3 inputs
and descales, which ptxattn allocates from CuPy's pool (as its other temporaries;
ptxattn/interop.py) and torch frees.

The Python functions (``attention``, ``attention_varlen``, ``fp8_attention``,
``attention_with_kvcache``, ``ring_attention``) check that their tensor arguments are torch
tensors on a CUDA device (meta and fake tensors pass, for tracing) of the dtypes the kernels
take before calling an op, so that a CPU tensor gets a TypeError naming the argument rather than
the dispatcher's error for an op with no CPU kernel. ``fp8_attention`` also checks that k and v
have q's dtype (its op quantizes each on its own, so nothing inside would notice) and that its
recipe is an ``Fp8Recipe``; every other check is ptxattn's own, inside the op.

``ring_attention`` (context parallelism: each rank of a torch.distributed NCCL process group
holds a shard of the sequence; ptxattn.distributed, docs/guide/distributed.md) is a
``torch.autograd.Function``, not a custom op: its process group is no schema type. It runs
eagerly (torch.compile breaks the graph around it), on torch's current stream, its K/V exchanges
on torch's NCCL stream; its outputs come from CuPy's pool.

``enable_sdpa``, ``disable_sdpa`` and the context manager ``sdpa_enabled`` make ptxattn the
flash-attention implementation of ``torch.nn.functional.scaled_dot_product_attention``, through
torch's registry of them (``torch.nn.attention.register_flash_attention_impl``, torch 2.11 and
newer, the way FlashAttention 4 plugs in): activating "ptxattn" registers Python kernels for
``aten::_scaled_dot_product_flash_attention`` and its backward on CUDA over torch's own. They
run ptxattn's kernels for the calls ptxattn has kernels for (16-bit, head_dim a multiple of 8
from 8 to 256, value's head_dim a multiple of 8 at most it, no dropout) and torch's
FlashAttention 2 ops, ``aten::_flash_attention_forward`` and ``_flash_attention_backward``,
which stay torch's, for the others, as torch's own kernels do.
"""

import contextlib
import functools
import math
from typing import Optional, Sequence

import torch

from . import api, archs, dispatch, fp8, serving
from .problem.checks import ALIGN_BYTES, SCALE_BLOCK_ROWS
from .launchers.hopper_backward import FP8_HEAD_DIMS as FP8_BACKWARD_HEAD_DIMS
from .quant.recipe import Fp8Recipe

__all__ = ["attention", "attention_varlen", "fp8_attention", "attention_with_kvcache",
           "attention_mla_decode", "ring_attention", "enable_sdpa", "disable_sdpa",
           "sdpa_enabled"]

# What the backward ops return: dq, dk, dv and dsinks.
_Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# A KV cache: the queries' 16-bit dtype, or e4m3 with its descales
_CACHE_DTYPES = (*_SIXTEEN_BIT, torch.float8_e4m3fn)
# Where the ops run: CUDA tensors, and meta (or fake) tensors, which reach the fake kernels when
# torch.compile or opcheck traces a call.
_DEVICE_TYPES = ("cuda", "meta")


def __dir__():
    return sorted(__all__)


def _check_tensor(name: str, x, dtypes: tuple, dtype_names: str) -> None:
    """A TypeError naming ``name`` unless ``x`` is a torch tensor on a CUDA (or meta) device
    with one of ``dtypes``: checked before a custom op is entered, whose dispatcher would
    otherwise answer a CPU tensor with its own long error."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor on a CUDA device, got "
                        f"{type(x).__module__}.{type(x).__name__}")
    if x.device.type not in _DEVICE_TYPES:
        raise TypeError(f"{name} must be a CUDA tensor (ptxattn's kernels run on the GPU), got "
                        f"a tensor on {x.device}; move it with {name}.cuda()")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_names}, got {x.dtype}")


def _check_16bit(**tensors) -> None:
    for name, x in tensors.items():
        _check_tensor(name, x, _SIXTEEN_BIT, "float16 or bfloat16")


def _check_optional(dtype: torch.dtype, **tensors) -> None:
    """Each of ``tensors`` that is not None: a CUDA tensor of ``dtype``."""
    for name, x in tensors.items():
        if x is not None:
            _check_tensor(name, x, (dtype,), str(dtype).removeprefix("torch."))


def _out_shape(q: torch.Tensor, v: torch.Tensor) -> tuple[int, ...]:
    """The output's shape: q's, (batch, seqlen, heads, head_dim) or packed (total_q, heads,
    head_dim), with v's head_dim_v in place of head_dim."""
    return (*q.shape[:-1], v.shape[-1])


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """(batch, heads_q, seqlen_q): the float32 log-sum-exp's shape for q (batch, seqlen, heads,
    dim)."""
    return (q.shape[0], q.shape[2], q.shape[1])


def _detached(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x without its autograd history (ptxattn refuses tensors that require grad), or None.
    The ops run below autograd, on tensors that may still require grad."""
    return None if x is None else x.detach()


def _empty_dsinks(sinks: Optional[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor for a backward op's dsinks: float32 like ``sinks``, or the (0,)
    stand-in for a call without sinks (an op's tuple of tensors holds no None)."""
    return q.new_empty((0,), dtype=torch.float32) if sinks is None else sinks.new_empty(sinks.shape)


def _sinks_gradient(sinks: Optional[torch.Tensor], dsinks: torch.Tensor):
    """An autograd formula's gradient for the sinks: None for a call without sinks (dsinks is
    then the (0,) stand-in), dsinks otherwise."""
    return None if sinks is None else dsinks


# ---------------------------------------------------------------------------------------------
# attention


@torch.library.custom_op("ptxattn::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], window: Sequence[int], softcap: float,
                  sinks: Optional[torch.Tensor], deterministic: bool,
                  backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention's output and float32 log-sum-exp (``deterministic`` is the backward's,
    kept here because the autograd formula sees only the forward's inputs)."""
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32)
    return api.attention(q.detach(), k.detach(), v.detach(), causal=causal,
                         softmax_scale=softmax_scale, return_lse=True,
                         out=q.new_empty(_out_shape(q, v)), lse=lse, backend=backend,
                         window=tuple(window), softcap=softcap, sinks=_detached(sinks))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, window, softcap, sinks, deterministic,
                        backend):
    return q.new_empty(_out_shape(q, v)), q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("ptxattn::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], window: Sequence[int], softcap: float,
                  sinks: Optional[torch.Tensor], deterministic: bool,
                  backend: Optional[str]) -> _Gradients:
    """ptxattn.attention_backward's (dq, dk, dv) and dsinks: float32 (heads_q,), summed over
    the batch and the rows, or of shape (0,) without sinks."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dsinks = _empty_dsinks(sinks, q)
    api.attention_backward(
        dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
        causal=causal, softmax_scale=softmax_scale, window=tuple(window), softcap=softcap,
        sinks=_detached(sinks), deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        dsinks=None if sinks is None else dsinks, backend=backend)
    return dq, dk, dv, dsinks


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window, softcap, sinks,
                        deterministic, backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _empty_dsinks(sinks, q))


def _attention_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window, softcap, sinks, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.options = (causal, softmax_scale, window, softcap)
    ctx.backward_options = (deterministic, backend)
    # The backward computes no gradient through the log-sum-exp: callers see it as a constant.
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    # dout has whatever layout the consumer of out gave it (stride 0 after out.sum(), say);
    # the kernels read rows of head_dim with positive, 16-byte aligned strides.
    dq, dk, dv, dsinks = attention_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.options, sinks,
                                       *ctx.backward_options)
    # None for causal, softmax_scale, window, softcap, and for deterministic, backend
    return (dq, dk, dv, None, None, None, None, _sinks_gradient(sinks, dsinks), None, None)


attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, window=(-1, -1), softcap: float = 0.0,
              sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
              deterministic: bool = False, backend: Optional[str] = None):
    """Scaled dot-product attention, ``softmax(softmax_scale * q k^T) v``, differentiable.

    ``ptxattn.attention`` as the custom op ``ptxattn::attention_fwd``, its backward
    ``ptxattn::attention_bwd`` (``ptxattn.attention_backward``) joined by
    ``register_autograd``: gradients flow to q, k, v and ``sinks``, and torch.compile traces
    forward and backward into one graph. Runs on torch's current stream; the output comes from
    torch's caching allocator. Layout rules as ``ptxattn.attention`` states them (unit stride in
    head_dim, 16-byte aligned base and batch/seqlen/heads strides, otherwise free). A window, a
    softcap or sinks run on a serving build, as ``ptxattn.attention`` describes.

    Parameters
    ----------
    q : torch.Tensor
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device;
        head_dim a multiple of 8 from 8 to 256.
    k : torch.Tensor
        Keys, (batch, seqlen_k, heads_kv, head_dim), q's dtype and device; heads_q a multiple
        of heads_kv (GQA/MQA).
    v : torch.Tensor
        Values, (batch, seqlen_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a
        multiple of 8 at most head_dim (narrower value heads, as in multi-head latent
        attention).
    causal : bool, default False
        Masks key j from query i unless j <= i + seqlen_k - seqlen_q (bottom-right aligned).
    softmax_scale : float, optional
        The scale of the scores; 1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        (left, right): query i sees keys i + seqlen_k - seqlen_q - left up to
        i + seqlen_k - seqlen_q + right; -1 is unbounded (right is 0 when causal).
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap).
    sinks : torch.Tensor, optional
        float32 (heads_q,), contiguous, on q's device: logits that join every row's softmax
        denominator. It may require grad: its gradient is summed over the batch and the rows.
    return_lse : bool, default False
        Also return the log-sum-exp.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.
    backend : {'hopper', 'portable'}, optional
        The kernel family, as in ``ptxattn.attention``.

    Returns
    -------
    out : torch.Tensor
        (batch, seqlen_q, heads_q, head_dim_v) in q's dtype.
    lse : torch.Tensor
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log, sinks
        included; it carries no gradient.

    Raises
    ------
    TypeError
        q, k or v not a torch tensor, not on a CUDA device (a CPU tensor), or not float16 or
        bfloat16; ``sinks`` not a float32 CUDA tensor; then, inside the op, every TypeError of
        ``ptxattn.attention``.
    ValueError
        As ``ptxattn.attention`` raises it (shapes, strides, head_dim, devices, options), and
        in the backward as ``ptxattn.attention_backward`` does.

    Examples
    --------
    >>> import torch, ptxattn.torch
    >>> q = torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16,
    ...                 requires_grad=True)
    >>> k, v = (torch.randn(2, 1024, 4, 128, device="cuda", dtype=torch.bfloat16,
    ...                     requires_grad=True) for _ in range(2))
    >>> out = ptxattn.torch.attention(q, k, v, causal=True)
    >>> out.float().square().mean().backward()
    >>> q.grad.shape, k.grad.shape
    (torch.Size([2, 1024, 16, 128]), torch.Size([2, 1024, 4, 128]))

    A sliding window (each query sees its own key and the 256 before it) and a learned sink
    per head:

    >>> sinks = torch.zeros(16, device="cuda", requires_grad=True)
    >>> out = ptxattn.torch.attention(q, k, v, causal=True, window=(256, 0), sinks=sinks)
    >>> out.float().square().mean().backward()
    >>> sinks.grad.shape
    torch.Size([16])
    """
    _check_16bit(q=q, k=k, v=v)
    _check_optional(torch.float32, sinks=sinks)
    out, lse = attention_fwd(q, k, v, causal, softmax_scale, tuple(window), softcap, sinks,
                             deterministic, backend)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Variable-length batches


@torch.library.custom_op("ptxattn::attention_varlen_fwd", mutates_args=(), device_types="cuda")
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float], window: Sequence[int], softcap: float,
                         sinks: Optional[torch.Tensor], deterministic: bool,
                         check_contents: bool,
                         backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention_varlen's output and float32 log-sum-exp (heads_q, total_q)
    (``deterministic`` is the backward's, kept here for the autograd formula)."""
    return serving.attention_varlen(
        q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window=tuple(window),
        softcap=softcap, sinks=_detached(sinks), return_lse=True,
        out=q.new_empty(_out_shape(q, v)),
        lse=q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
        check_contents=check_contents, backend=backend)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, softmax_scale, window, softcap, sinks, deterministic,
                               check_contents, backend):
    return (q.new_empty(_out_shape(q, v)),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("ptxattn::attention_varlen_bwd", mutates_args=(), device_types="cuda")
def attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                         causal: bool, softmax_scale: Optional[float], window: Sequence[int],
                         softcap: float, sinks: Optional[torch.Tensor], deterministic: bool,
                         check_contents: bool, backend: Optional[str]) -> _Gradients:
    """ptxattn.attention_varlen_backward's (dq, dk, dv) and dsinks: float32 (heads_q,),
    summed over every sequence's rows, or of shape (0,) without sinks."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    dsinks = _empty_dsinks(sinks, q)
    serving.attention_varlen_backward(
        dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
        softmax_scale=softmax_scale, window=tuple(window), softcap=softcap,
        sinks=_detached(sinks), deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        dsinks=None if sinks is None else dsinks, check_contents=check_contents,
        backend=backend)
    return dq, dk, dv, dsinks


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, causal, softmax_scale, window,
                               softcap, sinks, deterministic, check_contents, backend):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            _empty_dsinks(sinks, q))


def _attention_varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
     window, softcap, sinks, deterministic, check_contents, backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    ctx.options = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window, softcap)
    ctx.backward_options = (deterministic, backend)
    ctx.mark_non_differentiable(lse)


def _attention_varlen_backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks = ctx.saved_tensors
    deterministic, backend = ctx.backward_options
    # The forward checked the cu_seqlens' contents if asked to, and saved tensors are what it
    # saw (autograd refuses a backward after they were changed in place): the backward skips the
    # check and its synchronization. dout may come in any layout, as in attention's backward.
    dq, dk, dv, dsinks = attention_varlen_bwd(
        dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.options, sinks,
        deterministic, False, backend)
    # None for the cu_seqlens, the max_seqlens, causal, softmax_scale, window, softcap, and for
    # deterministic, check_contents, backend
    return (dq, dk, dv, None, None, None, None, None, None, None, None,
            _sinks_gradient(sinks, dsinks), None, None, None)


attention_varlen_fwd.register_autograd(_attention_varlen_backward,
                                       setup_context=_attention_varlen_setup_context)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, window=(-1, -1),
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                     return_lse: bool = False, deterministic: bool = False,
                     check_contents: bool = True, backend: Optional[str] = None):
    """``ptxattn.attention_varlen`` on CUDA tensors, as a custom op, differentiable.

    The custom op ``ptxattn::attention_varlen_fwd``, its backward
    ``ptxattn::attention_varlen_bwd`` (``ptxattn.attention_varlen_backward``) joined by
    ``register_autograd``: gradients flow to q, k, v and ``sinks`` (none to the cu_seqlens),
    and torch.compile traces forward and backward into one graph. Runs on torch's current
    stream; the outputs and gradients come from torch's caching allocator. Every option is
    ``ptxattn.attention_varlen``'s, with its rules; there is no ``out``.

    Parameters
    ----------
    q : torch.Tensor
        Queries, (total_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device, the
        sequences packed back to back; head_dim a multiple of 8 from 8 to 256.
    k : torch.Tensor
        Keys, (total_k, heads_kv, head_dim), q's dtype.
    v : torch.Tensor
        Values, (total_k, heads_kv, head_dim_v), k's shape but for head_dim_v, a multiple of 8
        at most head_dim.
    cu_seqlens_q, cu_seqlens_k : torch.Tensor
        int32 (batch + 1,) cumulative lengths, from 0, on q's device. The backward reads them
        as the forward saw them: autograd refuses it after they were changed in place.
    max_seqlen_q, max_seqlen_k : int
        Bounds on the sequences' lengths.
    causal : bool, default False
        Bottom-right aligned per sequence.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    window : tuple of (int, int), default (-1, -1)
        (left, right) keys around each sequence's diagonal; -1 is unbounded.
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap).
    sinks : torch.Tensor, optional
        float32 (heads_q,): logits that join every row's softmax denominator. It may require
        grad: its gradient is summed over every sequence's rows.
    return_lse : bool, default False
        Also return the log-sum-exp.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.
    check_contents : bool, default True
        Copy the cu_seqlens to the host to check them (a synchronization), in the forward; the
        backward relies on that check.
    backend : {'hopper', 'portable'}, optional
        The kernel family.

    Returns
    -------
    out : torch.Tensor
        (total_q, heads_q, head_dim_v) in q's dtype.
    lse : torch.Tensor
        Only with ``return_lse``: float32 (heads_q, total_q), natural log, sinks included; it
        carries no gradient.

    Raises
    ------
    TypeError
        q, k, v not float16 or bfloat16 CUDA tensors, the cu_seqlens not int32 CUDA tensors,
        ``sinks`` not a float32 CUDA tensor; then, inside the op, every TypeError of
        ``ptxattn.attention_varlen``.
    ValueError
        As ``ptxattn.attention_varlen`` raises it, and in the backward as
        ``ptxattn.attention_varlen_backward`` does.

    Examples
    --------
    >>> cu_seqlens = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device="cuda")
    >>> q = torch.randn(16, 32, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    >>> k, v = (torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16,
    ...                     requires_grad=True) for _ in range(2))
    >>> out = ptxattn.torch.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 11, 11,
    ...                                      causal=True)
    >>> out.float().square().mean().backward()
    >>> q.grad.shape, k.grad.shape
    (torch.Size([16, 32, 128]), torch.Size([16, 8, 128]))
    """
    _check_16bit(q=q, k=k, v=v)
    _check_tensor("cu_seqlens_q", cu_seqlens_q, (torch.int32,), "int32")
    _check_tensor("cu_seqlens_k", cu_seqlens_k, (torch.int32,), "int32")
    _check_optional(torch.float32, sinks=sinks)
    out, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, tuple(window), softcap,
                                    sinks, deterministic, check_contents, backend)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# FP8 attention

# What the FP8 forward op returns: out and lse, then what its backward reads, the e4m3 q8, k8,
# v8 and their descales.
_Fp8Forward = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                    torch.Tensor, torch.Tensor, torch.Tensor]


def _descale_shape(x: torch.Tensor, granularity: str) -> tuple:
    """The shape of ``fp8.quantize``'s descale of x (batch, seqlen, heads, head_dim) at
    ``granularity``: (), (batch, heads), or (batch, heads, ceil(seqlen / 128))."""
    batch, seqlen, heads, _ = x.shape
    blocks = (seqlen + SCALE_BLOCK_ROWS - 1) // SCALE_BLOCK_ROWS
    return {"tensor": (), "head": (batch, heads), "block": (batch, heads, blocks)}[granularity]


@functools.lru_cache(maxsize=32)
def _rotation_matrix(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """R of ``fp8.hadamard_rotation(head_dim, seed)``, the rotation ``fp8.quantize_qkv`` drew
    from that seed, float32 (head_dim, head_dim) on ``device``. Kept: copying it from host
    memory in every backward would make the host wait for the GPU (torch's blocking copy)."""
    matrix = fp8.hadamard_rotation(head_dim, seed).matrix()
    return torch.from_numpy(matrix).to(device=device, dtype=torch.float32)


def _rotated_back(grad: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """grad R^T in grad's dtype, computed in FP32: the gradient for x of one for x R."""
    return torch.matmul(grad.float(), rotation.T).to(grad.dtype)


@torch.library.custom_op("ptxattn::fp8_attention_fwd", mutates_args=(), device_types="cuda")
def fp8_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      softmax_scale: Optional[float], granularity: str, rotate: bool, seed: int,
                      deterministic: bool) -> _Fp8Forward:
    """ptxattn.fp8.attention of q, k, v quantized by ptxattn.fp8.quantize_qkv as the recipe
    (granularity, rotate, seed) says: the output in q's dtype and the float32 log-sum-exp, then
    q8, k8, v8 (float8_e4m3fn) and their float32 descales, which the backward reads
    (``deterministic`` is the backward's, kept for the autograd formula)."""
    recipe = Fp8Recipe(granularity, rotate, seed)
    q8, k8, v8, descales = fp8.quantize_qkv(q.detach(), k.detach(), v.detach(),
                                            recipe.granularity, recipe.rotate, recipe.seed)
    out, lse = fp8.attention(q8, k8, v8, **descales, causal=causal, softmax_scale=softmax_scale,
                             return_lse=True, out=q.new_empty(_out_shape(q, v)))
    return (out, lse, q8, k8, v8, descales["q_descale"], descales["k_descale"],
            descales["v_descale"])


@fp8_attention_fwd.register_fake
def _fp8_attention_fwd_fake(q, k, v, causal, softmax_scale, granularity, rotate, seed,
                            deterministic):
    # The granularity alone sets the shapes (and is checked as the real op checks it); the seed
    # may be a symbolic int here, which a recipe refuses.
    recipe = Fp8Recipe(granularity)
    quantized = [x.new_empty(x.shape, dtype=torch.float8_e4m3fn) for x in (q, k, v)]
    descales = [x.new_empty(_descale_shape(x, g), dtype=torch.float32)
                for x, g in ((q, recipe.granularity), (k, recipe.granularity),
                             (v, recipe.v_granularity))]
    return (q.new_empty(_out_shape(q, v)), q.new_empty(_lse_shape(q), dtype=torch.float32),
            *quantized, *descales)


@torch.library.custom_op("ptxattn::fp8_attention_bwd", mutates_args=(), device_types="cuda")
def fp8_attention_bwd(dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, q_descale: torch.Tensor,
                      k_descale: torch.Tensor, v_descale: torch.Tensor, causal: bool,
                      softmax_scale: Optional[float], rotate: bool, seed: int,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ptxattn.fp8.attention_backward's (dq, dk, dv) in out's dtype, with respect to the 16-bit
    inputs: the kernel's are with respect to the dequantized q8, k8, v8, which with ``rotate``
    stand for q R and k R; their dq and dk are rotated back by R^T here (R from ``seed``, as
    the forward drew it)."""
    dq, dk, dv = (x.new_empty(x.shape, dtype=out.dtype) for x in (q8, k8, v8))
    fp8.attention_backward(
        dout.detach(), q8.detach(), k8.detach(), v8.detach(), out.detach(), lse.detach(),
        q_descale=q_descale.detach(), k_descale=k_descale.detach(),
        v_descale=v_descale.detach(), causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    if rotate:
        rotation = _rotation_matrix(q8.shape[-1], seed, dq.device)
        dq, dk = _rotated_back(dq, rotation), _rotated_back(dk, rotation)
    return dq, dk, dv


@fp8_attention_bwd.register_fake
def _fp8_attention_bwd_fake(dout, q8, k8, v8, out, lse, q_descale, k_descale, v_descale, causal,
                            softmax_scale, rotate, seed, deterministic):
    return tuple(x.new_empty(x.shape, dtype=out.dtype) for x in (q8, k8, v8))


def _fp8_attention_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, granularity, rotate, seed, deterministic = inputs
    out, lse, *quantized = output
    ctx.save_for_backward(out, lse, *quantized)
    ctx.options = (causal, softmax_scale, rotate, seed, deterministic)
    # Only out carries a gradient: the caller sees lse and the quantized inputs as constants.
    ctx.mark_non_differentiable(lse, *quantized)


def _fp8_attention_backward(ctx, dout, *constant_gradients):
    out, lse, q8, k8, v8, q_descale, k_descale, v_descale = ctx.saved_tensors
    causal, softmax_scale, rotate, seed, deterministic = ctx.options
    # dout may come in any layout, as in attention's backward
    dq, dk, dv = fp8_attention_bwd(dout.contiguous(), q8, k8, v8, out, lse, q_descale,
                                   k_descale, v_descale, causal, softmax_scale, rotate, seed,
                                   deterministic)
    # None for causal, softmax_scale, granularity, rotate, seed and deterministic
    return dq, dk, dv, None, None, None, None, None, None


fp8_attention_fwd.register_autograd(_fp8_attention_backward,
                                    setup_context=_fp8_attention_setup_context)


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  softmax_scale: Optional[float] = None, recipe: Optional[Fp8Recipe] = None,
                  deterministic: bool = False) -> torch.Tensor:
    """FP8 attention of 16-bit tensors, ``softmax(softmax_scale * q k^T) v``, differentiable.

    q, k and v are quantized to e4m3 on the GPU as ``recipe`` says (``ptxattn.fp8.quantize_qkv``),
    and ``ptxattn.fp8.attention`` runs on them: the custom op ``ptxattn::fp8_attention_fwd``,
    its backward ``ptxattn::fp8_attention_bwd`` (``ptxattn.fp8.attention_backward``) joined by
    ``register_autograd``, so that torch.compile traces forward and backward into one graph.
    The gradients are those of the dequantized inputs, passed through the quantizers as if they
    were the identity (a straight-through estimate), and with a rotation turned back into
    gradients of q and k. Autograd saves the e4m3 inputs and their descales rather than q, k, v.
    Runs on torch's current stream, on the GPUs ``ptxattn.fp8.attention`` runs on (sm_90a); the
    output comes from torch's caching allocator. Layout rules as ``ptxattn.fp8.quantize``
    states them (unit stride in head_dim, 16-byte aligned base and batch/seqlen/heads strides).
    docs/guide/fp8.md gives the error to expect: several percent of the gradients' norm, most of
    it from quantizing the inputs.

    Parameters
    ----------
    q : torch.Tensor
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device;
        head_dim 64, 128 or 256.
    k : torch.Tensor
        Keys, (batch, seqlen_k, heads_kv, head_dim), q's dtype and device; heads_q a multiple
        of heads_kv (GQA/MQA).
    v : torch.Tensor
        Values, k's shape (FP8 takes no narrower value heads), q's dtype.
    causal : bool, default False
        Masks key j from query i unless j <= i + seqlen_k - seqlen_q (bottom-right aligned).
    softmax_scale : float, optional
        The scale of the scores; 1 / sqrt(head_dim) by default.
    recipe : ptxattn.fp8.Fp8Recipe, optional
        How q, k and v are quantized: descale granularity, Hadamard rotation of q and k and its
        seed; ``Fp8Recipe()`` (per 128-row block for q and k, per head for v, no rotation) by
        default.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.

    Returns
    -------
    torch.Tensor
        The output, (batch, seqlen_q, heads_q, head_dim) in q's dtype.

    Raises
    ------
    TypeError
        q, k or v not a torch tensor, not on a CUDA device, or not float16 or bfloat16; k or v
        not of q's dtype; ``recipe`` not an Fp8Recipe; then, inside the op, every TypeError of
        ``ptxattn.fp8.quantize`` and ``ptxattn.fp8.attention``.
    ValueError
        As ``ptxattn.fp8.quantize`` and ``ptxattn.fp8.attention`` raise it (shapes, strides,
        head_dim, a rotation at a head_dim other than 64, 128 or 256, a GPU other than sm_90a),
        and in the backward as ``ptxattn.fp8.attention_backward`` does.

    Examples
    --------
    >>> import torch, ptxattn.torch
    >>> from ptxattn.fp8 import Fp8Recipe
    >>> q = torch.randn(2, 4096, 16, 128, device="cuda", dtype=torch.bfloat16,
    ...                 requires_grad=True)
    >>> k, v = (torch.randn(2, 4096, 4, 128, device="cuda", dtype=torch.bfloat16,
    ...                     requires_grad=True) for _ in range(2))
    >>> out = ptxattn.torch.fp8_attention(q, k, v, causal=True)
    >>> out.float().square().mean().backward()
    >>> q.grad.dtype, k.grad.shape
    (torch.bfloat16, torch.Size([2, 4096, 4, 128]))

    Outlier-heavy activations: q and k rotated before they are quantized.

    >>> out = ptxattn.torch.fp8_attention(q, k, v, causal=True,
    ...                                   recipe=Fp8Recipe("block", rotate=True, seed=0))
    """
    _check_16bit(q=q, k=k, v=v)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have q's dtype, {q.dtype}, got {x.dtype}")
    # the forward takes more head dims than the backward: refused here, not in autograd
    if q.dim() == 4 and q.shape[-1] not in FP8_BACKWARD_HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {FP8_BACKWARD_HEAD_DIMS} for "
                         f"fp8_attention (its backward's), got {q.shape[-1]}")
    if recipe is None:
        recipe = Fp8Recipe()
    elif not isinstance(recipe, Fp8Recipe):
        raise TypeError(f"recipe must be a ptxattn.fp8.Fp8Recipe or None, got "
                        f"{type(recipe).__module__}.{type(recipe).__name__}")
    out, *_ = fp8_attention_fwd(q, k, v, causal, softmax_scale, recipe.granularity,
                                recipe.rotate, recipe.seed, deterministic)
    return out


# ---------------------------------------------------------------------------------------------
# KV caches (forward only)


@torch.library.custom_op("ptxattn::attention_with_kvcache_fwd", mutates_args=("k_cache", "v_cache"),
                         device_types="cuda")
def attention_with_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_seqlens: Optional[torch.Tensor], uniform_cache_seqlen: int,
                               block_table: Optional[torch.Tensor], k_new: Optional[torch.Tensor],
                               v_new: Optional[torch.Tensor], causal: bool,
                               window: Sequence[int], softcap: float,
                               sinks: Optional[torch.Tensor], softmax_scale: Optional[float],
                               num_splits: int, check_contents: bool,
                               backend: Optional[str], k_descale: Optional[torch.Tensor],
                               v_descale: Optional[torch.Tensor]
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention_with_kvcache's output and float32 log-sum-exp (batch, heads_q,
    seqlen_q), k_new and v_new written into the caches first. ``cache_seqlens`` is the int32
    (batch,) tensor of filled lengths, or None for one length of every sequence,
    ``uniform_cache_seqlen`` (a schema takes no union of int and tensor)."""
    lengths = uniform_cache_seqlen if cache_seqlens is None else cache_seqlens
    return serving.attention_with_kvcache(
        q.detach(), k_cache.detach(), v_cache.detach(), cache_seqlens=lengths,
        block_table=block_table, k_new=_detached(k_new), v_new=_detached(v_new), causal=causal,
        window=tuple(window), softcap=softcap, sinks=_detached(sinks),
        softmax_scale=softmax_scale, num_splits=num_splits, return_lse=True,
        out=q.new_empty(_out_shape(q, v_cache)), check_contents=check_contents, backend=backend,
        k_descale=k_descale, v_descale=v_descale)


@attention_with_kvcache_fwd.register_fake
def _attention_with_kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, uniform_cache_seqlen,
                                     block_table, k_new, v_new, causal, window, softcap, sinks,
                                     softmax_scale, num_splits, check_contents, backend,
                                     k_descale, v_descale):
    return q.new_empty(_out_shape(q, v_cache)), q.new_empty(_lse_shape(q), dtype=torch.float32)


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens, block_table: Optional[torch.Tensor] = None,
                           k_new: Optional[torch.Tensor] = None,
                           v_new: Optional[torch.Tensor] = None, causal: bool = True,
                           window=(-1, -1), softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None,
                           softmax_scale: Optional[float] = None, num_splits: int = 0,
                           return_lse: bool = False, check_contents: bool = True,
                           backend: Optional[str] = None,
                           k_descale: Optional[torch.Tensor] = None,
                           v_descale: Optional[torch.Tensor] = None):
    """``ptxattn.attention_with_kvcache`` on CUDA tensors, as a custom op (forward only).

    The custom op ``ptxattn::attention_with_kvcache_fwd``, traceable by torch.compile, which
    declares k_cache and v_cache mutated: ``k_new`` and ``v_new`` are written into them in
    place, visible to the caller, also under torch.compile (the caches change only when k_new
    and v_new are given). It has no backward yet: a backward through it raises torch's "no
    autograd formula" error. Runs on torch's current stream; the output comes from torch's
    caching allocator, the lse from CuPy's pool. Every option is
    ``ptxattn.attention_with_kvcache``'s, with its rules (descales: tensors only); there is no
    ``out``.

    Parameters
    ----------
    q : torch.Tensor
        Queries, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, on a CUDA device;
        head_dim a multiple of 8 from 8 to 256.
    k_cache, v_cache : torch.Tensor
        A contiguous cache, (batch, seqlen_cache, heads_kv, head_dim), or a paged one,
        (num_pages, page_size, heads_kv, head_dim) with ``block_table``; q's dtype, or
        float8_e4m3fn (both) with ``k_descale`` and ``v_descale``. v_cache has k_cache's shape
        but for its last axis, head_dim_v: a multiple of 8 at most head_dim (e4m3: head_dim).
    cache_seqlens : int or torch.Tensor
        Each sequence's filled length: one int, or an int32 (batch,) CUDA tensor.
    block_table : torch.Tensor, optional
        For a paged cache: int32 (batch, max_pages), each sequence's pages in order.
    k_new, v_new : torch.Tensor, optional
        (batch, seqlen_new, heads_kv, head_dim), v_new with head_dim_v, appended at
        cache_seqlens before attending.
    causal : bool, default True
        Aligns the queries with the last keys (bottom-right).
    window : tuple of (int, int), default (-1, -1)
        (left, right) keys around that diagonal; -1 is unbounded.
    softcap : float, default 0.0
        When > 0, the scaled scores s become softcap * tanh(s / softcap).
    sinks : torch.Tensor, optional
        float32 (heads_q,): logits that join every row's softmax denominator.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    num_splits : int, default 0
        Key splits a sequence: 0 as many as fill the GPU, 1 none.
    return_lse : bool, default False
        Also return the log-sum-exp.
    check_contents : bool, default True
        Copy cache_seqlens and block_table to the host to check them (a synchronization).
    backend : {'hopper', 'portable'}, optional
        The kernel family.
    k_descale, v_descale : torch.Tensor, optional
        For e4m3 caches: float32 CUDA tensors of shape (1,) (per tensor) or (batch, heads_kv);
        a value is e4m3(byte) * descale. k_new and v_new are quantized into the caches with them.

    Returns
    -------
    out : torch.Tensor
        (batch, seqlen_q, heads_q, head_dim_v) in q's dtype.
    lse : torch.Tensor
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log, sinks
        included.

    Raises
    ------
    TypeError
        q, k_new or v_new not float16 or bfloat16 CUDA tensors, the caches not those or
        float8_e4m3fn; a tensor ``cache_seqlens`` or ``block_table`` not an int32 CUDA tensor;
        ``sinks`` or a descale not a float32 CUDA tensor; then, inside the op, every TypeError
        of ``ptxattn.attention_with_kvcache``.
    ValueError
        As ``ptxattn.attention_with_kvcache`` raises it.

    Examples
    --------
    >>> k_cache = torch.zeros(4, 4096, 8, 128, device="cuda", dtype=torch.bfloat16)
    >>> v_cache = torch.zeros_like(k_cache)
    >>> lengths = torch.tensor([100, 7, 250, 31], dtype=torch.int32, device="cuda")
    >>> q = torch.randn(4, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    >>> k_new, v_new = (torch.randn(4, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
    ...                 for _ in range(2))
    >>> out = ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
    ...                                            k_new=k_new, v_new=v_new)
    >>> lengths += 1
    """
    _check_16bit(q=q)
    _check_caches(k_cache=k_cache, v_cache=v_cache)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), "int32")
    _check_optional(torch.int32, block_table=block_table)
    _check_optional(torch.float32, sinks=sinks, k_descale=k_descale, v_descale=v_descale)
    if k_new is not None:
        _check_16bit(k_new=k_new)
    if v_new is not None:
        _check_16bit(v_new=v_new)
    tensor = isinstance(cache_seqlens, torch.Tensor)
    out, lse = attention_with_kvcache_fwd(
        q, k_cache, v_cache, cache_seqlens if tensor else None, 0 if tensor else cache_seqlens,
        block_table, k_new, v_new, causal, tuple(window), softcap, sinks, softmax_scale,
        num_splits, check_contents, backend, k_descale, v_descale)
    return (out, lse) if return_lse else out


def _check_caches(**caches) -> None:
    for name, x in caches.items():
        _check_tensor(name, x, _CACHE_DTYPES, "float16, bfloat16 or float8_e4m3fn")


@torch.library.custom_op("ptxattn::attention_mla_decode_fwd", mutates_args=("kv_cache",),
                         device_types="cuda")
def attention_mla_decode_fwd(q: torch.Tensor, kv_cache: torch.Tensor,
                             cache_seqlens: Optional[torch.Tensor], uniform_cache_seqlen: int,
                             block_table: Optional[torch.Tensor], kv_new: Optional[torch.Tensor],
                             kv_descale: Optional[torch.Tensor], softmax_scale: Optional[float],
                             causal: bool, num_splits: int, check_contents: bool
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention_mla_decode's output and float32 log-sum-exp (batch, heads_q,
    seqlen_q), kv_new written into the cache first; ``cache_seqlens`` as in
    attention_with_kvcache_fwd."""
    lengths = uniform_cache_seqlen if cache_seqlens is None else cache_seqlens
    return serving.attention_mla_decode(
        q.detach(), kv_cache.detach(), cache_seqlens=lengths, block_table=block_table,
        kv_new=_detached(kv_new), kv_descale=kv_descale, softmax_scale=softmax_scale,
        causal=causal, num_splits=num_splits, return_lse=True,
        out=q.new_empty(_mla_out_shape(q)), check_contents=check_contents)


@attention_mla_decode_fwd.register_fake
def _attention_mla_decode_fwd_fake(q, kv_cache, cache_seqlens, uniform_cache_seqlen,
                                   block_table, kv_new, kv_descale, softmax_scale, causal,
                                   num_splits, check_contents):
    return q.new_empty(_mla_out_shape(q)), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _mla_out_shape(q: torch.Tensor) -> tuple[int, ...]:
    from .launchers.portable_mla import HEAD_DIM_V
    return (*q.shape[:-1], HEAD_DIM_V)


def attention_mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, *, cache_seqlens,
                         block_table: Optional[torch.Tensor] = None,
                         kv_new: Optional[torch.Tensor] = None,
                         kv_descale: Optional[torch.Tensor] = None,
                         softmax_scale: Optional[float] = None, causal: bool = True,
                         num_splits: int = 0, return_lse: bool = False,
                         check_contents: bool = True):
    """``ptxattn.attention_mla_decode`` on CUDA tensors, as a custom op (forward only).

    The custom op ``ptxattn::attention_mla_decode_fwd``, traceable by torch.compile, which
    declares kv_cache mutated (``kv_new`` is written into it in place). Runs on torch's current
    stream; the output comes from torch's caching allocator, the lse from CuPy's pool. The
    options are ``ptxattn.attention_mla_decode``'s, with its rules (head_dim_v is 512; the
    descale a tensor); there is no ``out``.

    Parameters
    ----------
    q : torch.Tensor
        (batch, seqlen_q, heads_q, 576), float16 or bfloat16, on a CUDA device.
    kv_cache : torch.Tensor
        The latent cache, (batch, seqlen_cache, 1, 576) or paged (num_pages, page_size, 1, 576)
        with ``block_table``: q's dtype, or float8_e4m3fn with ``kv_descale``.
    cache_seqlens : int or torch.Tensor
        Each sequence's filled length: one int, or an int32 (batch,) CUDA tensor.
    block_table : torch.Tensor, optional
        For a paged cache: int32 (batch, max_pages).
    kv_new : torch.Tensor, optional
        (batch, seqlen_new, 1, 576) in q's dtype, appended at cache_seqlens first.
    kv_descale : torch.Tensor, optional
        For an e4m3 cache: float32, shape (1,) or (batch, 1).
    softmax_scale, causal, num_splits, return_lse, check_contents
        As ``ptxattn.attention_mla_decode``'s.

    Returns
    -------
    out : torch.Tensor
        (batch, seqlen_q, heads_q, 512) in q's dtype.
    lse : torch.Tensor
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q).

    Raises
    ------
    TypeError
        q or kv_new not a float16 or bfloat16 CUDA tensor, kv_cache not that or float8_e4m3fn;
        ``cache_seqlens`` or ``block_table`` not int32, ``kv_descale`` not float32; then,
        inside the op, every TypeError of ``ptxattn.attention_mla_decode``.
    ValueError
        As ``ptxattn.attention_mla_decode`` raises it.

    Examples
    --------
    >>> kv_cache = torch.zeros(4, 4096, 1, 576, device="cuda", dtype=torch.bfloat16)
    >>> lengths = torch.tensor([100, 7, 250, 31], dtype=torch.int32, device="cuda")
    >>> q = torch.randn(4, 1, 128, 576, device="cuda", dtype=torch.bfloat16)
    >>> kv_new = torch.randn(4, 1, 1, 576, device="cuda", dtype=torch.bfloat16)
    >>> out = ptxattn.torch.attention_mla_decode(q, kv_cache, cache_seqlens=lengths,
    ...                                          kv_new=kv_new, softmax_scale=192 ** -0.5)
    >>> lengths += 1
    """
    _check_16bit(q=q)
    _check_caches(kv_cache=kv_cache)
    if isinstance(cache_seqlens, torch.Tensor):
        _check_tensor("cache_seqlens", cache_seqlens, (torch.int32,), "int32")
    _check_optional(torch.int32, block_table=block_table)
    _check_optional(torch.float32, kv_descale=kv_descale)
    if kv_new is not None:
        _check_16bit(kv_new=kv_new)
    tensor = isinstance(cache_seqlens, torch.Tensor)
    out, lse = attention_mla_decode_fwd(
        q, kv_cache, cache_seqlens if tensor else None, 0 if tensor else cache_seqlens,
        block_table, kv_new, kv_descale, softmax_scale, causal, num_splits, check_contents)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Context parallelism: ring attention over a torch.distributed process group


class _RingAttention(torch.autograd.Function):
    """ptxattn.distributed's ring forward and backward as one differentiable function (eager
    only: torch.compile breaks the graph around it). ptxattn.distributed is imported on first
    use: importing it turns NVLink multicast off in NCCL's environment, which importing
    ptxattn.torch alone should not do."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, softmax_scale, deterministic):
        from . import distributed

        # The function runs below autograd, on tensors that may still require grad: ptxattn
        # refuses those.
        out, lse = distributed.ring_attention(q.detach(), k.detach(), v.detach(), group=group,
                                              causal=causal, softmax_scale=softmax_scale,
                                              return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (group, causal, softmax_scale, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from . import distributed

        group, causal, softmax_scale, deterministic = ctx.ring
        q, k, v, out, lse = (x.detach() for x in ctx.saved_tensors)
        # As attention's: dout may come with any layout (stride 0 after out.sum()).
        dq, dk, dv = distributed.ring_attention_backward(
            dout.detach().contiguous(), q, k, v, out, lse, group=group, causal=causal,
            softmax_scale=softmax_scale, deterministic=deterministic)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group,
                   causal: bool = False, softmax_scale: Optional[float] = None,
                   return_lse: bool = False, deterministic: bool = False):
    """This rank's shard of attention over a sequence sharded across the ranks of ``group``.

    Context parallelism, differentiable in q, k and v: ``ptxattn.distributed.ring_attention``
    and ``ring_attention_backward`` as one ``torch.autograd.Function``, not a custom op (its
    process group is no schema type), so it runs eagerly: torch.compile breaks the graph
    around it. It runs on torch's current stream, its K/V exchanges on torch's NCCL stream;
    its outputs come from CuPy's pool. Every rank of the group calls it together, and runs
    the backward together. Import ptxattn.distributed before creating the process group: it
    sets NCCL_NVLS_ENABLE=0 (and torch's multicast off), which NCCL reads when it creates a
    communicator.

    Parameters
    ----------
    q : torch.Tensor
        This rank's query shard, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, on
        a CUDA device; every rank's of the same shape.
    k, v : torch.Tensor
        This rank's key and value shards, (batch, seqlen_k, heads_kv, head_dim).
    group : torch.distributed.ProcessGroup or ptxattn.distributed.Transport
        A process group on the NCCL backend (or a Transport).
    causal : bool, default False
        Needs zigzag shards (``ptxattn.distributed.zigzag_shard``) of one sequence,
        seqlen_q == seqlen_k; non-causal attention takes any sharding.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    return_lse : bool, default False
        Also return the log-sum-exp.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run.

    Returns
    -------
    out : torch.Tensor
        This rank's output shard, like q.
    lse : torch.Tensor
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), over the whole
        sequence; it carries no gradient.

    Raises
    ------
    TypeError
        q, k or v not float16 or bfloat16 CUDA tensors; ``group`` of another kind; then every
        TypeError of ``ptxattn.distributed.ring_attention``.
    ValueError
        As ``ptxattn.distributed.ring_attention`` raises it (a causal call on shards that are
        not zigzag shards of one even length, a group not on the NCCL backend, ...).

    Examples
    --------
    >>> import torch.distributed as dist
    >>> import ptxattn.distributed as cp, ptxattn.torch
    >>> dist.init_process_group("nccl")
    >>> rank, world = dist.get_rank(), dist.get_world_size()
    >>> q, k, v = (cp.zigzag_shard(x, world, rank).requires_grad_()
    ...            for x in (q_all, k_all, v_all))   # each rank's shards of the whole
    >>> out = ptxattn.torch.ring_attention(q, k, v, group=dist.group.WORLD, causal=True)
    >>> out.float().square().mean().backward()   # dk, dv summed over every rank's queries
    """
    _check_16bit(q=q, k=k, v=v)
    out, lse = _RingAttention.apply(q, k, v, group, causal, softmax_scale, deterministic)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# torch's scaled_dot_product_attention: ptxattn as its flash-attention implementation

# ptxattn's name in torch's registry of flash-attention implementations
_SDPA_IMPL = "ptxattn"
# What enable_sdpa, disable_sdpa and sdpa_enabled use of that registry. torch 2.10 has the first
# three but no restore_flash_attention_impl: an implementation activated there stays for good.
_REGISTRY_FUNCTIONS = ("register_flash_attention_impl", "activate_flash_attention_impl",
                       "current_flash_attention_impl", "restore_flash_attention_impl")


def _flash_attention_registry():
    """torch.nn.attention, which holds torch's registry of flash-attention implementations, or
    a RuntimeError naming this torch's version and the registry functions it lacks."""
    from torch.nn import attention as registry

    missing = [name for name in _REGISTRY_FUNCTIONS if not hasattr(registry, name)]
    if missing:
        raise RuntimeError(
            f"ptxattn's SDPA backend needs torch 2.11 or newer: torch {torch.__version__} has no "
            + ", ".join(f"torch.nn.attention.{name}" for name in missing))
    return registry


@functools.cache
def _arch_of(device_index: int) -> Optional[str]:
    """ptxattn's compile target for a torch CUDA device, or None for a GPU it has no kernels
    for (torch's flash kernels run on some of those: sm_87, sm_110)."""
    try:
        return archs.arch_for_capability(*torch.cuda.get_device_capability(device_index))
    except archs.UnsupportedGpuError:
        return None


def _ptxattn_runs(arch: Optional[str], query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, dropout_p: float, is_causal: bool,
                  scale: Optional[float]) -> bool:
    """Whether ptxattn's kernels run an SDPA flash call on q, k, v (batch, heads, seqlen,
    head_dim), forward and backward, on an ``arch`` GPU (None: one without ptxattn kernels):
    non-empty float16 or bfloat16 tensors of one dtype, key's head_dim the query's and value's
    at most that, head dims that a route takes, no dropout, the default scale or a finite
    positive one. It reads only what the backward op gets too, so a backward asks it with its
    forward's arguments and gets the forward's answer: the output and log-sum-exp it receives
    always come from the same implementation."""
    if arch is None or dropout_p != 0.0:
        return False
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        return False
    tensors = (query, key, value)
    if any(x.dim() != 4 or x.numel() == 0 or x.dtype != query.dtype for x in tensors):
        return False
    head_dim, head_dim_v = query.shape[-1], value.shape[-1]
    if query.dtype not in _SIXTEEN_BIT or key.shape[-1] != head_dim:
        return False
    features = {"causal"} if is_causal else set()
    if query.shape[1] != key.shape[1]:
        features.add("gqa")
    input_format = str(query.dtype).removeprefix("torch.")
    try:
        for call_features in (features, features | {"backward"}):
            dispatch.select(arch, input_format, head_dim, features=call_features,
                            head_dim_v=head_dim_v)
    except ValueError:
        return False
    return True


def _kernel_layout(x: torch.Tensor) -> bool:
    """Whether ptxattn's kernels read or write ``x``, (batch, seqlen, heads, head_dim), where it
    is (the rule of ptxattn.problem.checks.check_rows): unit stride in head_dim, a 16-byte
    aligned base, batch/seqlen/heads strides that are multiples of 16 bytes, none zero or
    negative along a dimension longer than 1."""
    size = x.element_size()
    return (x.stride(-1) == 1 and x.data_ptr() % ALIGN_BYTES == 0
            and all(stride * size % ALIGN_BYTES == 0 and (stride > 0 or n == 1)
                    for n, stride in zip(x.shape[:-1], x.stride()[:-1])))


def _kernel_rows(x: torch.Tensor) -> torch.Tensor:
    """The (batch, seqlen, heads, head_dim) view of an SDPA operand (batch, heads, seqlen,
    head_dim) for the kernels, without its autograd history (ptxattn refuses tensors that
    require grad): the view itself where they read it in place, a contiguous copy otherwise
    (a broadcast k, a dout of stride 0)."""
    rows = x.detach().transpose(1, 2)
    return rows if _kernel_layout(rows) else rows.contiguous()


def _sdpa_output(query: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """A fresh SDPA output, (batch, heads, seqlen_q, value's head_dim): ``empty_like(query)``
    when the head dims agree (the strides torch's meta kernel gives it, which a compiled graph
    relies on), otherwise laid out in the order of query's strides."""
    if value.size(-1) == query.size(-1):
        return torch.empty_like(query)
    order = sorted(range(query.dim()), key=query.stride, reverse=True)
    shape = (*query.shape[:-1], value.size(-1))
    return query.new_empty([shape[d] for d in order]).permute([order.index(d)
                                                                for d in range(len(order))])


def _kernel_target(output: torch.Tensor) -> torch.Tensor:
    """Where the kernels write a fresh (batch, heads, seqlen, head_dim) output: its (batch,
    seqlen, heads, head_dim) view where they can write that in place, a buffer of its own
    otherwise, which _copy_back copies into the output."""
    rows = output.transpose(1, 2)
    if _kernel_layout(rows):
        return rows
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)


def _copy_back(outputs, targets) -> None:
    """Copies each of ``targets`` that _kernel_target gave as a buffer of its own into its
    output."""
    for output, target in zip(outputs, targets):
        if target.data_ptr() != output.data_ptr():
            output.transpose(1, 2).copy_(target)


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                        return_debug_mask=False, *, scale=None):
    """aten::_scaled_dot_product_flash_attention on CUDA, what SDPA's flash backend calls on q,
    k, v (batch, heads, seqlen, head_dim): ptxattn's forward where _ptxattn_runs says so,
    otherwise what torch's own kernel does, FlashAttention 2 on the (batch, seqlen, heads,
    head_dim) views. The dispatcher leaves out trailing arguments that have their schema
    default, so the defaults here are the schema's."""
    max_q, max_k = query.size(2), key.size(2)
    # The debug mask (the dropout pattern) is FlashAttention 2's: asked for, the call is its,
    # and it refuses it without dropout as it does without ptxattn.
    if return_debug_mask or not _ptxattn_runs(_arch_of(query.device.index), query, key, value,
                                              dropout_p, is_causal, scale):
        out, lse, rng_state, unused, debug_mask = torch.ops.aten._flash_attention_forward(
            *(x.transpose(1, 2) for x in (query, key, value)), None, None, max_q, max_k,
            dropout_p, is_causal, return_debug_mask, scale=scale)
        return out.transpose(1, 2), lse, None, None, max_q, max_k, rng_state, unused, debug_mask
    out = _sdpa_output(query, value)
    lse = query.new_empty((query.size(0), query.size(1), max_q), dtype=torch.float32)
    target = _kernel_target(out)
    api.attention(*(_kernel_rows(x) for x in (query, key, value)), causal=is_causal,
                  softmax_scale=scale, out=target, lse=lse)
    _copy_back((out,), (target,))
    # No dropout, so no random state to hand the backward: zeros shaped as the meta kernel's.
    rng_state = query.new_zeros((2,), dtype=torch.uint64)
    philox_offset = query.new_zeros((), dtype=torch.uint64)
    return out, lse, None, None, max_q, max_k, rng_state, philox_offset, query.new_empty(0)


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                         scale=None):
    """aten::_scaled_dot_product_flash_attention_backward on CUDA: ptxattn's backward for the
    calls whose forward was ptxattn's (_ptxattn_runs on the forward's arguments), otherwise
    what torch's own kernel does, FlashAttention 2's backward on the (batch, seqlen, heads,
    head_dim) views. Deterministic under torch.use_deterministic_algorithms, as torch's."""
    if grad_out is None:  # an undefined gradient, which torch's own kernel passes on
        return None, None, None
    if not _ptxattn_runs(_arch_of(query.device.index), query, key, value, dropout_p, is_causal,
                         scale):
        grads = torch.ops.aten._flash_attention_backward(
            *(x.transpose(1, 2) for x in (grad_out, query, key, value, out)), logsumexp,
            cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed,
            philox_offset, scale=scale)
        return tuple(grad.transpose(1, 2) for grad in grads)
    # the meta kernel's strides: each gradient like its input
    grads = [torch.empty_like(x) for x in (query, key, value)]
    dq, dk, dv = targets = [_kernel_target(grad) for grad in grads]
    api.attention_backward(*(_kernel_rows(x) for x in (grad_out, query, key, value, out)),
                           logsumexp.detach(), causal=is_causal, softmax_scale=scale,
                           deterministic=torch.are_deterministic_algorithms_enabled(), dq=dq,
                           dk=dk, dv=dv)
    _copy_back(grads, targets)
    return tuple(grads)


class _SdpaKernels:
    """ptxattn's kernels for SDPA's flash ops in torch's dispatcher, over torch's own CUDA
    ones: what torch's registry calls to activate "ptxattn", and the handle it keeps, whose
    remove() puts torch's kernels back.

    Only the two ops SDPA's flash backend calls are taken. The FlashAttention 2 ops inside them,
    aten::_flash_attention_forward and _flash_attention_backward, stay torch's, so that the
    calls ptxattn has no kernels for still reach FlashAttention 2 (and what calls those ops
    directly, torch.nn.attention.varlen and nested tensors, keeps it)."""

    def __init__(self):
        self._library = torch.library.Library("aten", "IMPL", "CUDA")
        self._library.impl("_scaled_dot_product_flash_attention", _sdpa_flash_forward, "CUDA")
        self._library.impl("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward,
                           "CUDA")

    def remove(self) -> None:
        # now, rather than whenever the registry's last reference goes and the Library with it
        self._library._destroy()


def enable_sdpa() -> None:
    """Make ptxattn the flash-attention implementation of torch's scaled_dot_product_attention.

    Registers "ptxattn" in torch's registry of flash-attention implementations
    (``torch.nn.attention.register_flash_attention_impl``, torch 2.11 and newer) and activates
    it, which first restores torch's default (FlashAttention 2), so taking over from FA3 or FA4
    if one was active. From then on, every call torch's backend selection gives its flash
    backend runs ptxattn's forward and backward when ptxattn has kernels for it: CUDA float16
    or bfloat16 q, k, v of any head_dim up to 256 (SDPA pads it to a multiple of 8; ptxattn
    runs every multiple of 8 from 8 to 256), ``dropout_p=0``, causal or not, GQA
    (``enable_gqa=True``), any positive ``scale``, on a GPU ptxattn runs on. The flash op
    called directly with a value head_dim below the query's (a multiple of 8) runs on ptxattn
    too, its output of value's head_dim. The flash backend's other calls (dropout) run on
    FlashAttention 2 as without ptxattn, and calls the selection gives another backend (an
    ``attn_mask``, float32, head_dim over 256, ``is_causal`` with seqlen_q != seqlen_k, whose
    top-left alignment torch's flash backend refuses) never reach ptxattn. Forward and backward
    each dispatch when they run, so run ``.backward()`` while ptxattn is still active: the
    backward of a forward computed before ``enable_sdpa`` (or after ``disable_sdpa``) is not
    ptxattn's. The backward is deterministic under ``torch.use_deterministic_algorithms(True)``.

    torch tries its backends in its priority order, and where cuDNN attention comes before
    flash (on sm_90 and sm_100 with a cuDNN newer than 9.15, as torch 2.11's wheels bring) the
    calls cuDNN takes never reach the flash backend: select it with
    ``torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, or list it first with
    ``sdpa_kernel(..., set_priority=True)``. The flash op called directly
    (``torch.ops.aten._scaled_dot_product_flash_attention``) aligns ``is_causal`` bottom-right
    for seqlen_q != seqlen_k, as FlashAttention 2 and ptxattn do.

    Returns
    -------
    None

    Raises
    ------
    RuntimeError
        torch lacks the registry (older than 2.11): the message names its version and the
        missing functions.

    Examples
    --------
    >>> import torch, torch.nn.functional as F, ptxattn.torch
    >>> from torch.nn.attention import SDPBackend, sdpa_kernel
    >>> ptxattn.torch.enable_sdpa()
    >>> torch.nn.attention.current_flash_attention_impl()
    'ptxattn'
    >>> q, k, v = (torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16,
    ...                        requires_grad=True) for _ in range(3))   # (batch, heads, seq, dim)
    >>> with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # ptxattn's forward
    ...     out.float().square().mean().backward()                         # and backward
    >>> ptxattn.torch.disable_sdpa()
    """
    registry = _flash_attention_registry()
    registry.register_flash_attention_impl(_SDPA_IMPL, register_fn=_SdpaKernels)
    registry.activate_flash_attention_impl(_SDPA_IMPL)


def disable_sdpa() -> None:
    """Give scaled_dot_product_attention's flash backend back to torch's FlashAttention 2.

    ``torch.nn.attention.restore_flash_attention_impl`` when "ptxattn" is the active
    flash-attention implementation (``enable_sdpa``); nothing otherwise, so that an
    implementation activated since (FA4, say) stays.

    Returns
    -------
    None

    Raises
    ------
    RuntimeError
        torch lacks the registry (older than 2.11), as in ``enable_sdpa``.

    Examples
    --------
    >>> ptxattn.torch.enable_sdpa()
    >>> ptxattn.torch.disable_sdpa()
    >>> torch.nn.attention.current_flash_attention_impl() is None
    True
    """
    registry = _flash_attention_registry()
    if registry.current_flash_attention_impl() == _SDPA_IMPL:
        registry.restore_flash_attention_impl()


@contextlib.contextmanager
def sdpa_enabled():
    """A context in which ptxattn is scaled_dot_product_attention's flash implementation.

    ``enable_sdpa`` on entry; on exit, however the block ends, the flash-attention
    implementation active before it (torch's default, FA4, or "ptxattn" of an enclosing block)
    is activated again. A backward dispatches when it runs: call ``.backward()`` inside the block
    for ptxattn's gradients. What reaches ptxattn, and the priority of torch's backends, as in
    ``enable_sdpa``.

    Returns
    -------
    context manager
        Yields nothing.

    Raises
    ------
    RuntimeError
        On entry, when torch lacks the registry (older than 2.11), as in ``enable_sdpa``.

    Examples
    --------
    >>> import torch.nn.functional as F
    >>> from torch.nn.attention import SDPBackend, sdpa_kernel
    >>> with ptxattn.torch.sdpa_enabled(), sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ...     out.float().square().mean().backward()
    """
    registry = _flash_attention_registry()
    previous = registry.current_flash_attention_impl()
    enable_sdpa()
    try:
        yield
    finally:
        if previous is None:
            registry.restore_flash_attention_impl()
        else:
            registry.activate_flash_attention_impl(previous)
