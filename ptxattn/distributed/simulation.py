"""The ring of N simulated ranks on one GPU: the same schedules as ptxattn.distributed's entry
points (ptxattn/distributed/ring.py), driven in lockstep, each rank's messages copied into the
next rank's buffers where NCCL would send them. For tests and for timing the schedule on one
GPU."""

from __future__ import annotations

from ..interop import is_array
from ..problem import AttentionProblem
from .ring import _backward, _check_ring_shapes, _forward, ring_schedule
from .transports import DONE


def simulate_ring_attention(q_shards, k_shards, v_shards, *, causal: bool = False,
                            softmax_scale: float | None = None, return_lse: bool = False):
    """``ring_attention`` of N simulated ranks on one GPU, in lockstep.

    The same schedule as ``ring_attention``, each rank's messages copied into the next rank's
    buffers where NCCL would send them, on CuPy's current stream: the results are those N
    ranks would get.

    Parameters
    ----------
    q_shards, k_shards, v_shards : list or tuple of cupy.ndarray
        N shards each, rank r's at index r, as ``ring_attention`` takes them: of one shape per
        argument, all on one device. Causal: zigzag shards (``zigzag_shard``).
    causal : bool, default False
        As in ``ring_attention``.
    softmax_scale : float, optional
        1 / sqrt(head_dim) by default.
    return_lse : bool, default False
        Also return each rank's log-sum-exp.

    Returns
    -------
    outs : list of cupy.ndarray
        Each rank's output shard.
    lses : list of cupy.ndarray
        Only with ``return_lse``: each rank's float32 LSE (batch, heads_q, seqlen_q).
        ``zigzag_unshard`` (dim 1 for outputs, 2 for LSEs) puts causal results back in
        sequence order.

    Raises
    ------
    TypeError
        An argument not a list or tuple, or holding arrays of another library than CuPy;
        every TypeError of ``ptxattn.attention`` for a rank's shards.
    ValueError
        Lists of unlike lengths or empty; shards of one argument of unlike shapes or on
        different devices; a causal call whose q and k shards do not have one even seqlen;
        every ValueError of ``ptxattn.attention`` for a rank's shards.

    Examples
    --------
    >>> import cupy, ptxattn, ptxattn.distributed as cp
    >>> q, k, v = (cupy.random.standard_normal((1, 4096, 8, 128)).astype("bfloat16")
    ...            for _ in range(3))
    >>> shards = [[cp.zigzag_shard(x, 4, rank) for rank in range(4)] for x in (q, k, v)]
    >>> outs = cp.simulate_ring_attention(*shards, causal=True)
    >>> out = cp.zigzag_unshard(outs)   # ptxattn.attention(q, k, v, causal=True), to rounding
    """
    shards = _checked_shards(q=q_shards, k=k_shards, v=v_shards)
    world_size = len(shards["q"])
    for rank in range(world_size):
        q, k, v = (shards[name][rank] for name in "qkv")
        AttentionProblem.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale)
    _check_ring_shapes(shards["q"][0], shards["k"][0], causal, ("q_shards", "k_shards"))
    schedules = [_forward(shards["q"][r], shards["k"][r], shards["v"][r],
                          ring_schedule(r, world_size, shards["q"][r].shape[1], causal=causal),
                          softmax_scale) for r in range(world_size)]
    results = _run_in_lockstep(schedules, shards["q"][0].device.id)
    outs, lses = [out for out, _ in results], [lse for _, lse in results]
    return (outs, lses) if return_lse else outs


def simulate_ring_attention_backward(dout_shards, q_shards, k_shards, v_shards, out_shards,
                                     lse_shards, *, causal: bool = False,
                                     softmax_scale: float | None = None,
                                     deterministic: bool = False):
    """``ring_attention_backward`` of N simulated ranks on one GPU, in lockstep.

    As ``simulate_ring_attention`` runs the forward.

    Parameters
    ----------
    dout_shards, q_shards, k_shards, v_shards : list or tuple of cupy.ndarray
        N shards each, rank r's at index r.
    out_shards, lse_shards : list or tuple of cupy.ndarray
        What ``simulate_ring_attention(..., return_lse=True)`` returned.
    causal : bool, default False
        As in the forward.
    softmax_scale : float, optional
        As in the forward.
    deterministic : bool, default False
        As in ``ring_attention_backward``.

    Returns
    -------
    dq_shards, dk_shards, dv_shards : tuple of list of cupy.ndarray
        Each rank's gradients.

    Raises
    ------
    TypeError
        As ``simulate_ring_attention`` and ``ptxattn.attention_backward`` raise it.
    ValueError
        As ``simulate_ring_attention`` and ``ptxattn.attention_backward`` raise it.

    Examples
    --------
    >>> outs, lses = cp.simulate_ring_attention(*shards, causal=True, return_lse=True)
    >>> douts = [cupy.ones_like(out) for out in outs]
    >>> dqs, dks, dvs = cp.simulate_ring_attention_backward(douts, *shards, outs, lses,
    ...                                                     causal=True)
    >>> dq = cp.zigzag_unshard(dqs)
    """
    shards = _checked_shards(dout=dout_shards, q=q_shards, k=k_shards, v=v_shards,
                             out=out_shards, lse=lse_shards)
    world_size = len(shards["q"])
    for rank in range(world_size):
        AttentionProblem.from_backward(*(shards[name][rank] for name in shards), causal=causal,
                                       softmax_scale=softmax_scale, deterministic=deterministic)
    _check_ring_shapes(shards["q"][0], shards["k"][0], causal, ("q_shards", "k_shards"))
    schedules = [_backward(*(shards[name][r] for name in shards),
                           ring_schedule(r, world_size, shards["q"][r].shape[1], causal=causal),
                           softmax_scale, deterministic) for r in range(world_size)]
    results = _run_in_lockstep(schedules, shards["q"][0].device.id)
    return tuple(list(grads) for grads in zip(*results))


def _checked_shards(**named) -> dict:
    """Each sequence of shards as a list, checked: one shard per rank in every list, at least
    one rank, shards of one name alike in shape, all on one device. Arrays of other libraries
    are refused (the simulation runs on CuPy arrays); anything else is left to attention's
    checks."""
    import cupy

    lists = {}
    for name, shards in named.items():
        argument = f"{name}_shards"
        if not isinstance(shards, (list, tuple)):
            raise TypeError(f"{argument} must be a list or tuple of arrays, one a rank, got "
                            f"{type(shards).__name__}")
        for rank, x in enumerate(shards):
            if is_array(x) and not isinstance(x, cupy.ndarray):
                raise TypeError(f"{argument}[{rank}] must be a cupy.ndarray, got "
                                f"{type(x).__module__}.{type(x).__name__}")
            if tuple(x.shape) != tuple(shards[0].shape):
                raise ValueError(f"{argument}[{rank}] has shape {tuple(x.shape)}, "
                                 f"{argument}[0] {tuple(shards[0].shape)}: every rank's shard "
                                 f"has the same shape")
        lists[name] = list(shards)
    world_sizes = {name: len(shards) for name, shards in lists.items()}
    if len(set(world_sizes.values())) != 1:
        raise ValueError(f"every argument must hold one shard per rank, got lengths "
                         f"{world_sizes}")
    if next(iter(world_sizes.values())) < 1:
        raise ValueError("the simulation needs at least one rank (world size >= 1): the shard "
                         "lists are empty")
    device = lists["q"][0].device.id
    for name, shards in lists.items():
        for rank, x in enumerate(shards):
            if x.device.id != device:
                raise ValueError(f"{name}_shards[{rank}] must be on q_shards[0]'s device "
                                 f"{device} (the simulation runs on one GPU), got {x.device.id}")
    return lists


class _Finished:
    def __init__(self, value):
        self.value = value


def _run_in_lockstep(schedules: list, device: int) -> list:
    """Drives one schedule per simulated rank, step by step on one stream: once every rank has
    posted its Exchange, rank r's sends are copied into rank r + 1's recvs; a handle's wait()
    has nothing to wait for. Returns each rank's result."""
    import cupy

    handles = [None] * len(schedules)
    with cupy.cuda.Device(device):
        while True:
            posted = [_advance(schedule, handle) for schedule, handle in zip(schedules, handles)]
            finished = [isinstance(p, _Finished) for p in posted]
            if all(finished):
                return [p.value for p in posted]
            if any(finished):
                raise RuntimeError("the simulated ranks left the ring at different steps")
            for rank, exchange in enumerate(posted):
                receiver = posted[(rank + 1) % len(posted)]
                for sent, received in zip(exchange.sends, receiver.recvs, strict=True):
                    received[...] = sent
            handles = [DONE] * len(schedules)


def _advance(schedule, handle):
    """The schedule's next Exchange, or _Finished with its result."""
    try:
        return schedule.send(handle)
    except StopIteration as finished:
        return _Finished(finished.value)
