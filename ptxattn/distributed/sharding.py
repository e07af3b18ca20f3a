"""Zigzag sharding of a sequence over the ranks of a ring (as Megatron and ring-flash-attn shard
for causal attention): the sequence cut into 2N chunks, rank r holding chunks r and 2N-1-r.
ptxattn.distributed re-exports ``zigzag_shard`` and ``zigzag_unshard``."""

from __future__ import annotations

from ..interop import framework


def zigzag_shard(x, world_size: int, rank: int, dim: int = 1):
    """Rank ``rank``'s zigzag shard of ``x`` along the sequence axis ``dim``.

    ``x`` is cut into 2 * world_size equal chunks along ``dim``, and the shard is chunk
    ``rank`` followed by chunk 2 * world_size - 1 - rank: the sharding causal ring attention
    needs, so that every rank does the same work at every step.

    Parameters
    ----------
    x : array
        A NumPy, CuPy, torch or JAX array.
    world_size : int
        The number of ranks, >= 1.
    rank : int
        The rank, in [0, world_size).
    dim : int, default 1
        The sequence axis: 1 for (batch, seqlen, heads, head_dim) arrays, 2 for an LSE (batch,
        heads, seqlen); negative counts from the end. Its length must be a multiple of
        2 * world_size.

    Returns
    -------
    array
        A new array of x's kind, 1 / world_size of x's length along ``dim``.

    Raises
    ------
    ValueError
        A ``world_size``, ``rank`` or ``dim`` out of range (or not an int), or a length along
        ``dim`` that is not a multiple of 2 * world_size.

    Examples
    --------
    >>> import numpy as np
    >>> from ptxattn.distributed import zigzag_shard
    >>> x = np.arange(8)[None, :]   # (1, 8): the sequence along dim 1
    >>> zigzag_shard(x, 2, 0), zigzag_shard(x, 2, 1)
    (array([[0, 1, 6, 7]]), array([[2, 3, 4, 5]]))
    """
    _check_world_size(world_size)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, world_size) = [0, {world_size}), "
                         f"got {rank!r}")
    dim = _sequence_dim(x, dim)
    chunks = 2 * world_size
    if x.shape[dim] % chunks:
        raise ValueError(f"x's length along dim {dim} ({x.shape[dim]}) must be a multiple of "
                         f"2 * world_size = {chunks} for zigzag sharding")
    size = x.shape[dim] // chunks
    return _concatenate([_rows(x, dim, slice(c * size, (c + 1) * size))
                         for c in (rank, chunks - 1 - rank)], dim)


def zigzag_unshard(shards, dim: int = 1):
    """The whole sequence from every rank's zigzag shard: the inverse of ``zigzag_shard``.

    Parameters
    ----------
    shards : sequence of array
        Every rank's shard, ``shards[r]`` rank r's, as ``zigzag_shard`` made them: of one
        shape and kind (NumPy, CuPy, torch or JAX).
    dim : int, default 1
        The sequence axis (2 for LSEs); the shards' length along it must be even.

    Returns
    -------
    array
        The whole sequence, of the shards' kind.

    Raises
    ------
    ValueError
        ``shards`` empty or not a sequence; shards of unlike shapes; an odd length along
        ``dim``; a ``dim`` out of range.

    Examples
    --------
    >>> from ptxattn.distributed import zigzag_unshard
    >>> zigzag_unshard([zigzag_shard(x, 2, rank) for rank in range(2)])
    array([[0, 1, 2, 3, 4, 5, 6, 7]])
    """
    if isinstance(shards, (str, bytes)) or not hasattr(shards, "__len__") or len(shards) == 0:
        raise ValueError("shards must be a non-empty sequence of arrays, one a rank")
    dim = _sequence_dim(shards[0], dim)
    for rank, shard in enumerate(shards):
        if tuple(shard.shape) != tuple(shards[0].shape):
            raise ValueError(f"shards[{rank}] has shape {tuple(shard.shape)}, shards[0] "
                             f"{tuple(shards[0].shape)}: every rank's shard has the same shape")
    if shards[0].shape[dim] % 2:
        raise ValueError(f"shards must have an even length along dim {dim} (two chunks each), "
                         f"got {shards[0].shape[dim]}")
    size = shards[0].shape[dim] // 2
    world_size = len(shards)
    first_halves = [_rows(shard, dim, slice(0, size)) for shard in shards]
    second_halves = [_rows(shards[world_size - 1 - c], dim, slice(size, 2 * size))
                     for c in range(world_size)]
    return _concatenate(first_halves + second_halves, dim)


def _check_world_size(world_size) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")


def _sequence_dim(x, dim: int) -> int:
    ndim = len(x.shape)
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise ValueError(f"dim must be an int in [-{ndim}, {ndim}) for an array of shape "
                         f"{tuple(x.shape)}, got {dim!r}")
    return dim % ndim


def _rows(x, dim: int, rows: slice):
    return x[(slice(None),) * dim + (rows,)]


def _concatenate(parts: list, dim: int):
    first = parts[0]
    if framework(first) == "torch":
        import torch
        return torch.cat(parts, dim=dim)
    if hasattr(first, "__array_namespace__"):  # NumPy 2, JAX
        return first.__array_namespace__().concat(parts, axis=dim)
    import cupy
    return cupy.concatenate(parts, axis=dim)
