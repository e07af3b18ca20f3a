"""ptxattn for PyTorch: attention as torch.library custom ops, traceable by torch.compile and
differentiable through ptxattn's backward. Imported only as ``ptxattn.torch``.

    import ptxattn.torch
    out = ptxattn.torch.attention(q, k, v, causal=True)   # CUDA tensors (batch, seqlen, heads, dim)
    out.float().square().mean().backward()                 # q.grad, k.grad, v.grad

The ops, neither of which mutates its inputs:

- ``ptxattn::attention_fwd(q, k, v, causal, softmax_scale, deterministic, backend) -> (out, lse)``
- ``ptxattn::attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
  backend) -> (dq, dk, dv)``

Each has a fake implementation (shapes and dtypes only, the strides the real one gives), so that
torch.compile traces it without running it, and the forward's autograd formula calls the
backward op. Both run on torch's current stream, with their outputs allocated by torch's caching
allocator (ptxattn's own temporaries come from CuPy's pool; ptxattn.interop).

Every entry point follows this pattern: an op pair ``<name>_fwd`` / ``<name>_bwd`` whose forward
takes every argument its backward needs, a fake for each, one ``register_autograd`` joining them,
and a public function. The varlen and KV-cache entry points (issue #16) are to be added as such
pairs, beside attention's.
"""

from typing import Optional

import torch

from . import api

_NO_GRAD = (None, None, None, None)  # for causal, softmax_scale, deterministic, backend


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """(batch, heads_q, seqlen_q): the float32 log-sum-exp's shape for q (batch, seqlen, heads,
    dim)."""
    return (q.shape[0], q.shape[2], q.shape[1])


# ---------------------------------------------------------------------------------------------
# attention


@torch.library.custom_op("ptxattn::attention_fwd", mutates_args=(), device_types="cuda")
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], deterministic: bool,
                  backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention's output and float32 log-sum-exp (``deterministic`` is the backward's,
    kept here because the autograd formula sees only the forward's inputs)."""
    out = q.new_empty(q.shape)
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32)
    # The op runs below autograd, on tensors that may still require grad: ptxattn refuses those.
    api.attention(q.detach(), k.detach(), v.detach(), causal=causal,
                  softmax_scale=softmax_scale, out=out, lse=lse, backend=backend)
    return out, lse


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, softmax_scale, deterministic, backend):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("ptxattn::attention_bwd", mutates_args=(), device_types="cuda")
def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  out: torch.Tensor, lse: torch.Tensor, causal: bool,
                  softmax_scale: Optional[float], deterministic: bool,
                  backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ptxattn.attention_backward's (dq, dk, dv)."""
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    api.attention_backward(dout.detach(), q.detach(), k.detach(), v.detach(), out.detach(),
                           lse.detach(), causal=causal, softmax_scale=softmax_scale,
                           deterministic=deterministic, dq=dq, dk=dk, dv=dv, backend=backend)
    return dq, dk, dv


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, deterministic, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _attention_setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, deterministic, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, softmax_scale, deterministic, backend)
    # The backward computes no gradient through the log-sum-exp: callers see it as a constant.
    ctx.mark_non_differentiable(lse)


def _attention_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # dout has whatever layout the consumer of out gave it (stride 0 after out.sum(), say);
    # the kernels read rows of head_dim with positive, 16-byte aligned strides.
    dq, dk, dv = attention_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.options)
    return (dq, dk, dv, *_NO_GRAD)


attention_fwd.register_autograd(_attention_backward, setup_context=_attention_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              softmax_scale: Optional[float] = None, return_lse: bool = False,
              deterministic: bool = False, backend: Optional[str] = None):
    """softmax(softmax_scale * q k^T) v, differentiable in q, k and v.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim): CUDA
    tensors of float16 or bfloat16, as :func:`ptxattn.attention` takes them (unit stride in
    head_dim, other strides free, heads_q a multiple of heads_kv; bottom-right aligned
    ``causal``; ``softmax_scale`` 1/sqrt(head_dim) by default). Returns the output (batch,
    seqlen_q, heads_q, head_dim), and with ``return_lse`` also the float32 log-sum-exp (batch,
    heads_q, seqlen_q), which carries no gradient. ``deterministic`` makes the gradients
    bit-identical from run to run; ``backend`` picks the kernel family as in ptxattn.attention.
    """
    out, lse = attention_fwd(q, k, v, causal, softmax_scale, deterministic, backend)
    return (out, lse) if return_lse else out
