"""The ring: which queries meet which keys at each step (:func:`ring_schedule`), one rank's
program written once as a generator that yields an :class:`Exchange` where it communicates, and
the entry points that drive it over a transport."""

from __future__ import annotations

import dataclasses
import functools

from ..interop import framework_arrays
from ..problem import AttentionProblem
from .transports import Transport, transport_for


@dataclasses.dataclass(frozen=True)
class RingStep:
    """One step of a rank's ring: its queries ``query_rows`` (local rows of q) attend to the
    ``key_rows`` of the K/V shard that rank ``source`` started with, causally (bottom-right) or
    not."""

    source: int
    query_rows: slice
    key_rows: slice
    causal: bool


def ring_schedule(rank: int, world_size: int, seqlen: int, *, causal: bool) -> tuple:
    """The steps (:class:`RingStep`) of rank ``rank``: step s attends to the K/V of rank
    (rank - s) mod N.

    Non-causal: every step is all queries against all keys. Causal, zigzag shards of ``seqlen``
    rows (chunks rank and 2N-1-rank, c = seqlen / 2 rows each): step 0 is causal attention of the
    shard to itself, right because its chunks keep their order; from a rank j < rank, all
    queries see chunk j, the first half of its K/V, and none sees chunk 2N-1-j; from a rank
    j > rank, only the second half of the queries (chunk 2N-1-rank) sees anything, and it sees
    both chunks. Each step is c x 2c scores (step 0: half of 2c x 2c), on every rank alike.
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
    """One ring exchange: each of ``sends`` goes to the next rank, each of ``recvs`` is filled
    from the previous one (the previous rank's sends, in order). The generator that yields it
    gets back a handle whose ``wait()`` orders later work on the compute stream after the
    exchange."""

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
    parts = cupy.zeros((2, *q.shape), dtype=cupy.float32)
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
    """This rank's shard of attention over the whole sequence, the sequence sharded over the
    ranks of ``group``.

    q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim): this
    rank's shards, as :func:`ptxattn.attention` takes arrays (float16 or bfloat16, head_dim 64,
    128 or 256, GQA), every rank's of the same shapes. ``causal``: the shards must be zigzag
    shards (:func:`zigzag_shard`) of one sequence, seqlen_q == seqlen_k; non-causal: any
    sharding. ``group``: a torch.distributed ProcessGroup on the NCCL backend, a
    cupy.cuda.nccl.NcclCommunicator, or a :class:`Transport`. Returns the output like q and,
    with ``return_lse``, the float32 LSE (batch, heads_q, seqlen_q) over all keys. Every rank of
    the group must call it together, with the same arguments but its own arrays. Bad arguments
    raise before anything is launched or sent.
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
    """The gradients (dq, dk, dv) of :func:`ring_attention` for this rank's shards.

    dout: the gradient of the loss with respect to this rank's ``out``; ``out`` and ``lse``
    what ring_attention(..., return_lse=True) returned on this rank (the LSE over the whole
    sequence). Arrays as :func:`ptxattn.attention_backward` takes them, ``group``, ``causal``
    and ``softmax_scale`` as in the forward. Returns dq, dk, dv in the input dtype; dk and dv
    are summed over every rank's queries (and over the q heads of a kv head) in FP32, in ring
    order. ``deterministic=True`` makes them bit-identical from run to run (each step's
    attention_backward is then deterministic, and the ring's own sums run in a fixed order).
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
