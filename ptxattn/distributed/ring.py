"""The ring: which queries meet which keys at each step (``ring_schedule``), one rank's program
written once as a generator that yields an ``Exchange`` where it communicates, and the entry
points that drive it over a transport (ptxattn/distributed/transports.py). ptxattn.distributed
re-exports the public names."""

from __future__ import annotations

import dataclasses
import functools

from ..interop import framework_arrays
from ..problem import AttentionProblem
from .transports import Transport, transport_for


@dataclasses.dataclass(frozen=True)
class RingStep:
    """One step of a rank's ring: which of its queries attend to which keys of whose K/V shard.

    Its queries ``query_rows`` (local rows of q) attend to the ``key_rows`` of the K/V shard
    that rank ``source`` started with, causally (bottom-right aligned) or not. ``ring_schedule``
    makes them.

    Attributes
    ----------
    source : int
        The rank whose K/V shard the step attends to.
    query_rows : slice
        Rows of this rank's q (and out, lse, dout) along the sequence.
    key_rows : slice
        Rows of the source's K/V shard along the sequence.
    causal : bool
        Whether the step is causal attention (bottom-right aligned) of those rows.

    Examples
    --------
    >>> from ptxattn.distributed import ring_schedule
    >>> step = ring_schedule(1, 2, 8, causal=True)[1]   # rank 1 of 2, second step
    >>> step.source, step.query_rows, step.key_rows, step.causal
    (0, slice(None, None, None), slice(0, 4, None), False)
    """

    source: int
    query_rows: slice
    key_rows: slice
    causal: bool


def ring_schedule(rank: int, world_size: int, seqlen: int, *, causal: bool) -> tuple:
    """The steps of rank ``rank`` in a ring of N = ``world_size`` ranks.

    Step s attends to the K/V of rank (rank - s) mod N.

    Non-causal: every step is all queries against all keys. Causal, zigzag shards of ``seqlen``
    rows (chunks rank and 2N-1-rank, c = seqlen / 2 rows each): step 0 is causal attention of
    the shard to itself, right because its chunks keep their order; from a rank j < rank, all
    queries see chunk j, the first half of its K/V, and none sees chunk 2N-1-j; from a rank
    j > rank, only the second half of the queries (chunk 2N-1-rank) sees anything, and it sees
    both chunks. Each step is c x 2c scores (step 0: half of 2c x 2c), on every rank alike.

    Parameters
    ----------
    rank : int
        The rank, in [0, world_size).
    world_size : int
        N, the number of ranks in the ring.
    seqlen : int
        The rows of one rank's shard (causal: both of its chunks, an even number).
    causal : bool
        Causal attention over zigzag shards, or non-causal attention over any sharding.

    Returns
    -------
    tuple of RingStep
        One step per rank, in ring order (step 0 the rank's own K/V).

    Examples
    --------
    >>> from ptxattn.distributed import ring_schedule
    >>> [(step.source, step.query_rows, step.causal)
    ...  for step in ring_schedule(0, 2, 8, causal=True)]
    [(0, slice(None, None, None), True), (1, slice(4, None, None), False)]
    """
    if not causal:
        return tuple(RingStep((rank - s) % world_size, slice(None), slice(None), False)
                     for s in range(world_size))
    half = seqlen // 2
    steps = [RingStep(rank, slice(None), slice(None), True)]
    for s in range(1, world_size):
        source = (rank - s) % world_size
        if source < rank:
            steps.append(RingStep(source, slice(None), slice(0, half), False))
        else:
            steps.append(RingStep(source, slice(half, None), slice(None), False))
    return tuple(steps)


def _check_ring_shapes(q, k, causal: bool, names: tuple = ("q", "k")) -> None:
    """What the ring adds to attention's own checks: causal shards are zigzag shards, so q and
    k have one even length."""
    if not causal:
        return
    q_name, k_name = names
    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(f"causal ring attention takes zigzag shards (zigzag_shard): {q_name} and "
                         f"{k_name} must have one seqlen, an even number (two chunks), got "
                         f"{q.shape[1]} and {k.shape[1]}")


# ---------------------------------------------------------------------------------------------
# The rank's program, written once: generators that yield an Exchange where they communicate


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One ring exchange: arrays sent to the next rank and buffers filled from the previous one.

    Each of ``sends`` goes to rank (rank + 1) mod N, each of ``recvs`` is filled from rank
    (rank - 1) mod N (the previous rank's sends, in order). A rank's schedule yields it where it
    communicates and gets back the handle of ``Transport.start(sends, recvs)``, whose ``wait()``
    orders later work on the compute stream after the exchange.

    Attributes
    ----------
    sends : tuple of cupy.ndarray
        Contiguous arrays to send.
    recvs : tuple of cupy.ndarray
        Contiguous buffers to receive into, of the previous rank's sends' sizes.

    Examples
    --------
    How ``ring_attention`` drives a rank's schedule over a transport:

    >>> exchange = schedule.send(handle)             # the schedule's next Exchange
    >>> handle = transport.start(exchange.sends, exchange.recvs)
    """

    sends: tuple
    recvs: tuple


def _forward(q, k, v, steps: tuple, softmax_scale):
    """One rank's ring forward: yields its Exchanges, returns (out in q's dtype, lse float32).

    Each step's partial state is merged into the state so far by combine.cu (split_kv.combine)
    over the step's query rows: parts[0] holds the merged output in FP32, parts[1] the step's,
    and the merge writes its output over parts[0] (a lane reads a column of every part before
    it writes that column) and its LSE beside, copied into lse_parts[0] after."""
    import cupy

    from ..api import attention
    from ..launchers import split_kv

    batch, seqlen, heads, _ = q.shape
    parts = cupy.zeros((2, batch, seqlen, heads, v.shape[-1]), dtype=cupy.float32)
    lse_parts = cupy.full((2, batch, heads, seqlen), -cupy.inf, dtype=cupy.float32)
    merged_lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
    for step, (held, arriving) in zip(steps, _relay((k, v), len(steps))):
        pending = (yield Exchange(held, arriving)) if arriving is not None else None
        k_step, v_step = (x[:, step.key_rows] for x in held)
        rows = step.query_rows
        parts[1][:, rows], lse_parts[1][:, :, rows] = attention(
            q[:, rows], k_step, v_step, causal=step.causal, softmax_scale=softmax_scale,
            return_lse=True)
        split_kv.combine(parts[:, :, rows], lse_parts[:, :, :, rows], parts[0][:, rows],
                         merged_lse[:, :, rows])
        lse_parts[0][:, :, rows] = merged_lse[:, :, rows]
        if pending is not None:
            pending.wait()
    return parts[0].astype(q.dtype), lse_parts[0]


def _backward(dout, q, k, v, out, lse, steps: tuple, softmax_scale, deterministic: bool):
    """One rank's ring backward: yields its Exchanges, returns (dq, dk, dv) in q's dtype.

    dK and dV travel in FP32 accumulators one step behind their K/V: the accumulator a rank
    finished at step s - 1 goes on at step s (beside the step's attention, with the next K/V),
    the one for the step's K/V arrives from the previous rank, which finished it at step s - 1,
    and after the last step one more exchange hands each rank the sums for its own K/V."""
    import cupy

    from ..api import attention_backward

    world_size = len(steps)
    dq = cupy.zeros(q.shape, dtype=cupy.float32)
    # grads[0] starts the sums of the rank's own K/V; from step 1 the two take turns arriving
    grads = [_alike((k, v), cupy.float32, zero=True)]
    grads += [_alike((k, v), cupy.float32)] if world_size > 1 else []
    for s, (step, (held, arriving)) in enumerate(zip(steps, _relay((k, v), world_size))):
        sends = (held if arriving is not None else ()) + (grads[(s - 1) % 2] if s else ())
        recvs = (arriving if arriving is not None else ()) + (grads[s % 2] if s else ())
        pending = (yield Exchange(sends, recvs)) if sends else None
        rows, keys = step.query_rows, step.key_rows
        dq_part, dk_part, dv_part = attention_backward(
            dout[:, rows], q[:, rows], held[0][:, keys], held[1][:, keys], out[:, rows],
            lse[:, :, rows], causal=step.causal, softmax_scale=softmax_scale,
            deterministic=deterministic)
        _accumulate(dq_part, dq[:, rows])
        if pending is not None:
            pending.wait()
        dk_sum, dv_sum = grads[s % 2]
        _accumulate(dk_part, dk_sum[:, keys])
        _accumulate(dv_part, dv_sum[:, keys])
    finished = grads[(world_size - 1) % 2]
    if world_size == 1:
        dk, dv = finished
    else:  # the last step held the next rank's K/V: its sums go home
        dk, dv = grads[world_size % 2]
        (yield Exchange(finished, (dk, dv))).wait()
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _relay(first: tuple, world_size: int):
    """(held, arriving) for each step of a ring that passes arrays on: held are the step's
    arrays, arriving the buffers the next step's come into (None at the last step). ``first``
    (the rank's own arrays, never written) is held at step 0, made contiguous for the wire; two
    buffers like it then take turns."""
    import cupy

    held = tuple(cupy.ascontiguousarray(x) for x in first)
    buffers = [_alike(held, held[0].dtype) for _ in range(min(world_size - 1, 2))]
    for s in range(world_size):
        arriving = buffers[s % 2] if s + 1 < world_size else None
        yield held, arriving
        held = arriving


def _alike(arrays: tuple, dtype, zero: bool = False) -> tuple:
    """Contiguous arrays of the shapes of ``arrays`` in ``dtype``: zeros, or uninitialized."""
    import cupy

    make = cupy.zeros if zero else cupy.empty
    return tuple(make(x.shape, dtype=dtype) for x in arrays)


@functools.cache
def _accumulate_kernel():
    import cupy

    return cupy.ElementwiseKernel("T part", "float32 acc", "acc += static_cast<float>(part)",
                                  "ptxattn_ring_accumulate")


def _accumulate(part, acc) -> None:
    """acc (FP32) += part (any float dtype), in place."""
    _accumulate_kernel()(part, acc)


def _run(schedule, transport: Transport):
    """Drives one rank's schedule on a real transport: returns what the schedule returns."""
    handle = None
    while True:
        try:
            exchange = schedule.send(handle)
        except StopIteration as finished:
            return finished.value
        handle = transport.start(exchange.sends, exchange.recvs)


# ---------------------------------------------------------------------------------------------
# Entry points


@framework_arrays
def ring_attention(q, k, v, *, group, causal: bool = False, softmax_scale: float | None = None,
                   return_lse: bool = False):
    """This rank's shard of attention over a sequence sharded across the ranks of ``group``.

    Context parallelism: each rank holds a shard of q, k and v along the sequence, and the K/V
    shards are passed around the ring (module docstring of ptxattn.distributed) while each step
    attends beside the exchange. Every rank of the group must call it together, with the same
    arguments but its own arrays. Kinds of array and streams as in ``ptxattn.attention`` (the
    exchanges run on a side stream, or torch's NCCL stream). Bad arguments raise before
    anything is launched or sent.

    Parameters
    ----------
    q : CUDA array
        This rank's query shard, (batch, seqlen_q, heads_q, head_dim), float16 or bfloat16, as
        ``ptxattn.attention`` takes arrays (head_dim a multiple of 8 from 8 to 256); every
        rank's of the same shape.
    k, v : CUDA array
        This rank's key and value shards, (batch, seqlen_k, heads_kv, head_dim) (v's last axis
        head_dim_v, at most head_dim, as ``ptxattn.attention`` takes it); heads_q a
        multiple of heads_kv (GQA).
    group : torch.distributed.ProcessGroup, cupy.cuda.nccl.NcclCommunicator or Transport
        The ring's ranks: a process group on the NCCL backend, a CuPy NCCL communicator (bound
        to q's device), or a ``Transport``.
    causal : bool, default False
        Causal attention over the whole sequence: the shards must be zigzag shards
        (``zigzag_shard``) of one sequence, seqlen_q == seqlen_k, an even number. Non-causal
        attention takes any sharding.
    softmax_scale : float, optional
        The scale of the scores; 1 / sqrt(head_dim) by default.
    return_lse : bool, default False
        Also return the log-sum-exp.

    Returns
    -------
    out : array
        This rank's output shard, like q.
    lse : array
        Only with ``return_lse``: float32 (batch, heads_q, seqlen_q), natural log, over all
        keys of the sequence.

    Raises
    ------
    TypeError
        ``group`` of none of the kinds above; every TypeError of ``ptxattn.attention``.
    ValueError
        A causal call whose q and k do not have one even seqlen; q on another device than the
        communicator's; a process group not on the NCCL backend; every ValueError of
        ``ptxattn.attention``.

    Examples
    --------
    On each rank of a torch.distributed job, with the whole q_all, k_all, v_all:

    >>> import torch.distributed as dist
    >>> import ptxattn.distributed as cp
    >>> rank, world = dist.get_rank(), dist.get_world_size()
    >>> q, k, v = (cp.zigzag_shard(x, world, rank) for x in (q_all, k_all, v_all))
    >>> out, lse = cp.ring_attention(q, k, v, group=dist.group.WORLD, causal=True,
    ...                              return_lse=True)
    """
    import cupy

    transport = transport_for(group)
    problem = AttentionProblem.from_16bit(q, k, v, causal=causal, softmax_scale=softmax_scale)
    _check_ring_shapes(q, k, causal)
    _check_transport_device(transport, problem.device)
    steps = ring_schedule(transport.rank, transport.world_size, q.shape[1], causal=causal)
    with cupy.cuda.Device(problem.device):
        out, lse = _run(_forward(q, k, v, steps, softmax_scale), transport)
    return (out, lse) if return_lse else out


@framework_arrays
def ring_attention_backward(dout, q, k, v, out, lse, *, group, causal: bool = False,
                            softmax_scale: float | None = None, deterministic: bool = False):
    """The gradients (dq, dk, dv) of ``ring_attention`` for this rank's shards.

    Walks the forward's ring with the final output and LSE, so every step's
    ``attention_backward`` gives exact partial gradients: dQ is summed on the rank in FP32, and
    dK/dV in FP32 accumulators that travel with their K/V one step behind and reach the rank
    that owns them after the last step. Every rank of the group calls it together.

    Parameters
    ----------
    dout : CUDA array
        The gradient of the loss with respect to this rank's ``out``.
    q, k, v : CUDA array
        This rank's shards, as the forward took them.
    out, lse : CUDA array
        What ``ring_attention(..., return_lse=True)`` returned on this rank (lse over the
        whole sequence), as ``ptxattn.attention_backward`` takes them.
    group : torch.distributed.ProcessGroup, cupy.cuda.nccl.NcclCommunicator or Transport
        As in the forward.
    causal : bool, default False
        As in the forward.
    softmax_scale : float, optional
        As in the forward.
    deterministic : bool, default False
        Makes the gradients bit-identical from run to run: each step's attention_backward is
        then deterministic, and the ring's own sums run in a fixed order.

    Returns
    -------
    dq, dk, dv : tuple of array
        In the input dtype, like q, k and v; dk and dv are summed over every rank's queries
        (and over the q heads of a kv head) in FP32, in ring order.

    Raises
    ------
    TypeError
        As ``ring_attention`` and ``ptxattn.attention_backward`` raise it.
    ValueError
        As ``ring_attention`` and ``ptxattn.attention_backward`` raise it.

    Examples
    --------
    >>> out, lse = cp.ring_attention(q, k, v, group=group, causal=True, return_lse=True)
    >>> dq, dk, dv = cp.ring_attention_backward(dout, q, k, v, out, lse, group=group,
    ...                                         causal=True)
    """
    import cupy

    transport = transport_for(group)
    problem = AttentionProblem.from_backward(dout, q, k, v, out, lse, causal=causal,
                                             softmax_scale=softmax_scale,
                                             deterministic=deterministic)
    _check_ring_shapes(q, k, causal)
    _check_transport_device(transport, problem.device)
    steps = ring_schedule(transport.rank, transport.world_size, q.shape[1], causal=causal)
    with cupy.cuda.Device(problem.device):
        return _run(_backward(dout, q, k, v, out, lse, steps, softmax_scale, deterministic),
                    transport)


def _check_transport_device(transport: Transport, device: int) -> None:
    if transport.device is not None and transport.device != device:
        raise ValueError(f"q must be on the communicator's device {transport.device}, got "
                         f"{device}")
