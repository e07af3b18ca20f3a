"""ptxattn for PyTorch: attention as torch.library custom ops, traceable by torch.compile and
differentiable through ptxattn's backward; the serving entry points as forward-only custom ops.
Imported only as ``ptxattn.torch``.

    import ptxattn.torch
    out = ptxattn.torch.attention(q, k, v, causal=True)   # CUDA tensors (batch, seqlen, heads, dim)
    out.float().square().mean().backward()                 # q.grad, k.grad, v.grad
    out = ptxattn.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                               k_new=k, v_new=v)   # appends k, v to the cache
    out = ptxattn.torch.ring_attention(q, k, v, group=group, causal=True)  # context parallel

The ops:

- ``ptxattn::attention_fwd(q, k, v, causal, softmax_scale, deterministic, backend) -> (out, lse)``
- ``ptxattn::attention_bwd(dout, q, k, v, out, lse, causal, softmax_scale, deterministic,
  backend) -> (dq, dk, dv)``
- ``ptxattn::attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, causal, softmax_scale, window, softcap, sinks, check_contents, backend) ->
  (out, lse)``
- ``ptxattn::attention_with_kvcache_fwd(q, k_cache, v_cache, cache_seqlens, uniform_cache_seqlen,
  block_table, k_new, v_new, causal, window, softcap, sinks, softmax_scale, num_splits,
  check_contents, backend) -> (out, lse)``, which mutates k_cache and v_cache (declared, so that
  torch.compile orders it and the caller sees the appended rows; they change only when k_new and
  v_new are given).

Each has a fake implementation (shapes and dtypes only, the strides the real one gives), so that
torch.compile traces it without running it. attention's pair is joined by ``register_autograd``:
its forward takes every argument its backward needs. The serving ops have no backward yet and no
autograd formula: they run on tensors that require grad, but a backward through them raises
torch's "no autograd formula was registered" error (at compile time under torch.compile, which
traces the backward with the forward), never a silent zero gradient. (torch.library refuses an
autograd formula for an op that mutates its inputs, so attention_with_kvcache's backward, when
there is one, will be a functional op of its own.) Every op runs on torch's current stream.
Outputs are allocated by torch's caching allocator, except the serving ops' lse, which ptxattn
allocates from CuPy's pool (as its other temporaries; ptxattn.interop) and torch frees.

``ring_attention`` (context parallelism: each rank of a torch.distributed NCCL process group
holds a shard of the sequence; ptxattn.distributed, docs/distributed.md) is a
``torch.autograd.Function``, not a custom op: its process group is no schema type. It runs
eagerly (torch.compile breaks the graph around it), on torch's current stream, its K/V exchanges
on torch's NCCL stream; its outputs come from CuPy's pool.
"""

from typing import Optional, Sequence

import torch

from . import api, serving

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


# ---------------------------------------------------------------------------------------------
# Serving: variable-length batches and KV caches, forward only


@torch.library.custom_op("ptxattn::attention_varlen_fwd", mutates_args=(), device_types="cuda")
def attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                         softmax_scale: Optional[float], window: Sequence[int], softcap: float,
                         sinks: Optional[torch.Tensor], check_contents: bool,
                         backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """ptxattn.attention_varlen's output and float32 log-sum-exp (heads_q, total_q)."""
    return serving.attention_varlen(
        q.detach(), k.detach(), v.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal=causal, softmax_scale=softmax_scale, window=tuple(window),
        softcap=softcap, sinks=_detached(sinks), return_lse=True, out=q.new_empty(q.shape),
        check_contents=check_contents, backend=backend)


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal, softmax_scale, window, softcap, sinks, check_contents,
                               backend):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("ptxattn::attention_with_kvcache_fwd", mutates_args=("k_cache", "v_cache"),
                         device_types="cuda")
def attention_with_kvcache_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               cache_seqlens: Optional[torch.Tensor], uniform_cache_seqlen: int,
                               block_table: Optional[torch.Tensor], k_new: Optional[torch.Tensor],
                               v_new: Optional[torch.Tensor], causal: bool,
                               window: Sequence[int], softcap: float,
                               sinks: Optional[torch.Tensor], softmax_scale: Optional[float],
                               num_splits: int, check_contents: bool,
                               backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
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
        out=q.new_empty(q.shape), check_contents=check_contents, backend=backend)


@attention_with_kvcache_fwd.register_fake
def _attention_with_kvcache_fwd_fake(q, k_cache, v_cache, cache_seqlens, uniform_cache_seqlen,
                                     block_table, k_new, v_new, causal, window, softcap, sinks,
                                     softmax_scale, num_splits, check_contents, backend):
    return q.new_empty(q.shape), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _detached(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x without its autograd history (ptxattn refuses tensors that require grad), or None."""
    return None if x is None else x.detach()


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                     max_seqlen_k: int, *, causal: bool = False,
                     softmax_scale: Optional[float] = None, window=(-1, -1),
                     softcap: float = 0.0, sinks: Optional[torch.Tensor] = None,
                     return_lse: bool = False, check_contents: bool = True,
                     backend: Optional[str] = None):
    """:func:`ptxattn.attention_varlen` on CUDA tensors, as a custom op (forward only).

    q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim) packed back to back;
    cu_seqlens_q/k int32 (batch + 1,) cumulative lengths; every option as there (no ``out``:
    the output comes from torch's allocator). Returns the output like q and, with
    ``return_lse``, the float32 log-sum-exp (heads_q, total_q). A backward through it raises.
    """
    out, lse = attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, tuple(window), softcap,
                                    sinks, check_contents, backend)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                           cache_seqlens, block_table: Optional[torch.Tensor] = None,
                           k_new: Optional[torch.Tensor] = None,
                           v_new: Optional[torch.Tensor] = None, causal: bool = True,
                           window=(-1, -1), softcap: float = 0.0,
                           sinks: Optional[torch.Tensor] = None,
                           softmax_scale: Optional[float] = None, num_splits: int = 0,
                           return_lse: bool = False, check_contents: bool = True,
                           backend: Optional[str] = None):
    """:func:`ptxattn.attention_with_kvcache` on CUDA tensors, as a custom op (forward only).

    q (batch, seqlen_q, heads_q, head_dim); a contiguous cache (batch, seqlen_cache, heads_kv,
    head_dim) or a paged one (num_pages, page_size, heads_kv, head_dim) with an int32 (batch,
    max_pages) ``block_table``; ``cache_seqlens`` an int or an int32 (batch,) tensor;
    ``k_new``/``v_new`` (batch, seqlen_new, heads_kv, head_dim) are written into k_cache and
    v_cache in place, visible to the caller, also under torch.compile. Every option as there (no
    ``out``: the output comes from torch's allocator). Returns the output like q and, with
    ``return_lse``, the float32 log-sum-exp (batch, heads_q, seqlen_q). A backward through it
    raises.
    """
    tensor = isinstance(cache_seqlens, torch.Tensor)
    out, lse = attention_with_kvcache_fwd(
        q, k_cache, v_cache, cache_seqlens if tensor else None, 0 if tensor else cache_seqlens,
        block_table, k_new, v_new, causal, tuple(window), softcap, sinks, softmax_scale,
        num_splits, check_contents, backend)
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
    """This rank's shard of softmax(softmax_scale * q k^T) v over a sequence sharded across the
    ranks of ``group``, differentiable in q, k and v (context parallelism).

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim): this
    rank's shards, CUDA tensors of float16 or bfloat16, every rank's of the same shapes;
    causal needs zigzag shards (``ptxattn.distributed.zigzag_shard``). ``group``: a
    torch.distributed process group on the NCCL backend (or a ptxattn.distributed.Transport).
    Every rank of the group calls it together, and runs the backward together. Returns the
    output shard and, with ``return_lse``, the float32 log-sum-exp over the whole sequence
    (batch, heads_q, seqlen_q), which carries no gradient. dk and dv are this rank's K/V's
    gradients, summed over every rank's queries. ``deterministic`` as in :func:`attention`.
    Import ptxattn.distributed before creating the process group: it sets NCCL_NVLS_ENABLE=0
    (and torch's multicast off), which NCCL reads when it creates a communicator.
    """
    out, lse = _RingAttention.apply(q, k, v, group, causal, softmax_scale, deterministic)
    return (out, lse) if return_lse else out
