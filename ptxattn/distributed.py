"""Context-parallel (ring) attention: the sequence sharded across GPUs, K/V passed rank to rank.

    import ptxattn.distributed as cp
    q, k, v = (cp.zigzag_shard(x, world_size, rank) for x in (q_all, k_all, v_all))
    out, lse = cp.ring_attention(q, k, v, group=group, causal=True, return_lse=True)
    dq, dk, dv = cp.ring_attention_backward(dout, q, k, v, out, lse, group=group, causal=True)

Each of N ranks holds a shard of q, k and v along the sequence; the results are the rank's shard
of attention over the whole sequence. ``group`` is a torch.distributed process group on the NCCL
backend (torch tensors, usually), a ``cupy.cuda.nccl.NcclCommunicator`` (CuPy arrays; NCCL from
the ``nvidia-nccl-cu13`` wheel, ``pip install ptxattn[nccl]``), or a :class:`Transport`.

The ring. At step s (0 .. N-1) rank i holds the K/V shard that rank (i - s) mod N started with,
attends its queries to it, merges the partial output into an FP32 accumulator by LSE, and has
already handed the shard on: the send to rank i + 1 and the receive from rank i - 1 of the next
step's shard are posted before the step's attention and run beside it (double buffers; on a side
stream that waits for the compute stream through events). The backward walks the same ring with
the final output and LSE, so every step's ``attention_backward`` gives exact partial gradients:
dQ is summed on the rank in FP32, and dK/dV are summed in FP32 accumulators that travel with
their K/V one step behind and reach the rank that owns them after the last step.

Sharding. Non-causal attention works with any sharding (usually contiguous blocks). Causal
attention needs the zigzag sharding (:func:`zigzag_shard`, as Megatron and ring-flash-attn shard):
the sequence cut into 2N chunks, rank r holding chunks r and 2N-1-r, so that every rank does the
same work at every step (:func:`ring_schedule`). Every rank's shards must have the same shapes.

The schedule is written once, as a generator per rank that yields an :class:`Exchange` where it
communicates. :func:`ring_attention` drives it with a real transport; the simulation
(:func:`simulate_ring_attention`, :func:`simulate_ring_attention_backward`) drives N of them in
lockstep on one GPU, with device copies for the messages. docs/distributed.md has the rest.

Importing this module sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 in the process's environment (NVLink multicast is never used; NCCL reads
its variable when it creates a communicator, so import this before creating one).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from .interop import framework, framework_arrays, is_array
from .problem import AttentionProblem

# NVLink multicast (NVLS, torch's symmetric-memory multimem) can put the GPUs of a shared host out
# of service: keep it off in this process, whatever was set before.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

_GROUP_KINDS = ("a torch.distributed ProcessGroup (NCCL backend), a "
                "cupy.cuda.nccl.NcclCommunicator or a ptxattn.distributed.Transport")


# ---------------------------------------------------------------------------------------------
# Zigzag sharding


def zigzag_shard(x, world_size: int, rank: int, dim: int = 1):
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim`` (the sequence; 1 for (batch, seqlen,
    heads, head_dim) arrays, 2 for an LSE (batch, heads, seqlen)): ``x`` cut into 2 *
    world_size equal chunks, chunk ``rank`` followed by chunk 2 * world_size - 1 - rank. Works on
    NumPy, CuPy, torch and JAX arrays alike, and returns a new array of the same kind."""
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
    """The whole sequence from every rank's zigzag shard (``shards[r]`` rank r's, as
    :func:`zigzag_shard` made them): the inverse of zigzag_shard along ``dim``."""
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


# ---------------------------------------------------------------------------------------------
# The schedule: which queries meet which keys at each step


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
    """One rank's ring forward: yields its Exchanges, returns (out in q's dtype, lse float32)."""
    import cupy

    from .api import attention

    out = cupy.zeros(q.shape, dtype=cupy.float32)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), -cupy.inf, dtype=cupy.float32)
    for step, (held, arriving) in zip(steps, _relay((k, v), len(steps))):
        pending = (yield Exchange(held, arriving)) if arriving is not None else None
        k_step, v_step = (x[:, step.key_rows] for x in held)
        part, part_lse = attention(q[:, step.query_rows], k_step, v_step, causal=step.causal,
                                   softmax_scale=softmax_scale, return_lse=True)
        _merge(out[:, step.query_rows], lse[:, :, step.query_rows], part, part_lse)
        if pending is not None:
            pending.wait()
    return out.astype(q.dtype), lse


def _backward(dout, q, k, v, out, lse, steps: tuple, softmax_scale, deterministic: bool):
    """One rank's ring backward: yields its Exchanges, returns (dq, dk, dv) in q's dtype.

    dK and dV travel in FP32 accumulators one step behind their K/V: the accumulator a rank
    finished at step s - 1 goes on at step s (beside the step's attention, with the next K/V),
    the one for the step's K/V arrives from the previous rank, which finished it at step s - 1,
    and after the last step one more exchange hands each rank the sums for its own K/V."""
    import cupy

    from .api import attention_backward

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
def _merge_kernel():
    import cupy

    # acc, acc_lse: the merged state so far; part, part_lse: a step's. The weights are taken
    # relative to the larger LSE; a row no part has seen yet (both -inf) keeps its zeros.
    return cupy.ElementwiseKernel(
        "T part, float32 part_lse, float32 acc_lse", "float32 acc",
        """
        const float top = fmaxf(acc_lse, part_lse);
        if (isfinite(top)) {
            const float w_acc = expf(acc_lse - top), w_part = expf(part_lse - top);
            acc = (acc * w_acc + static_cast<float>(part) * w_part) / (w_acc + w_part);
        }
        """, "ptxattn_ring_merge")


@functools.cache
def _accumulate_kernel():
    import cupy

    return cupy.ElementwiseKernel("T part", "float32 acc", "acc += static_cast<float>(part)",
                                  "ptxattn_ring_accumulate")


def _merge(acc, acc_lse, part, part_lse) -> None:
    """acc (FP32, (batch, rows, heads, dim)) and acc_lse ((batch, heads, rows)) become the
    attention state over their keys and the part's keys, in place."""
    import cupy

    def per_element(lse):
        return lse.transpose(0, 2, 1)[..., None]  # (batch, rows, heads, 1), broadcast over dim

    _merge_kernel()(part, per_element(part_lse), per_element(acc_lse), acc)
    cupy.logaddexp(acc_lse, part_lse, out=acc_lse)


def _accumulate(part, acc) -> None:
    """acc (FP32) += part (any float dtype), in place."""
    _accumulate_kernel()(part, acc)


# ---------------------------------------------------------------------------------------------
# Transports


class Transport:
    """Moves a ring exchange's arrays between processes: ``start(sends, recvs)`` sends each of
    ``sends`` to rank (rank + 1) mod world_size and receives each of ``recvs`` from rank
    (rank - 1) mod world_size, after the work queued so far on CuPy's current stream, and returns
    a handle whose ``wait()`` makes that stream wait for the transfer (:data:`DONE` where there
    is nothing to wait for). ``device`` is the GPU a transport is bound to, None if any. Subclass
    it to wrap another transport (scripts/profile_distributed.py times the schedule with the
    sends skipped)."""

    rank: int
    world_size: int
    device: int | None = None

    def start(self, sends: tuple, recvs: tuple):
        raise NotImplementedError


class _Done:
    """The handle of an exchange that is complete once posted."""

    def wait(self) -> None:
        pass


DONE = _Done()


class _StreamEvent:
    """An exchange queued on a side stream: wait() makes the compute stream wait for it."""

    def __init__(self, done, compute):
        self._done, self._compute = done, compute

    def wait(self) -> None:
        self._compute.wait_event(self._done)


@functools.cache
def _side_stream(device: int):
    """The stream the NCCL transfers of ``device`` run on, beside its compute."""
    import cupy

    with cupy.cuda.Device(device):
        return cupy.cuda.Stream(non_blocking=True)


class NcclTransport(Transport):
    """The ring over a CuPy NCCL communicator: one NCCL group of sends and receives per exchange
    (as bytes), on a side stream that waits for the compute stream's work so far."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.world_size, self.device = comm.rank_id(), comm.size(), comm.device_id()

    def start(self, sends: tuple, recvs: tuple) -> _StreamEvent:
        import cupy
        from cupy.cuda import nccl

        compute = cupy.cuda.get_current_stream()
        side = _side_stream(self.device)
        side.wait_event(compute.record())
        after, before = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        nccl.groupStart()
        try:
            for x in sends:
                self._comm.send(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, after, side.ptr)
            for x in recvs:
                self._comm.recv(x.data.ptr, x.nbytes, nccl.NCCL_UINT8, before, side.ptr)
        finally:
            nccl.groupEnd()
        return _StreamEvent(side.record(), compute)


class TorchTransport(Transport):
    """The ring over a torch.distributed process group (NCCL backend): each exchange one
    ``batch_isend_irecv`` of byte views of the arrays, issued with CuPy's current stream as
    torch's current one, so that torch's NCCL stream waits for the work queued so far and the
    handle's wait() makes that stream wait for the transfer."""

    def __init__(self, group):
        import torch.distributed as dist

        backend = str(dist.get_backend(group))
        if "nccl" not in backend:
            raise ValueError(f"group must be a process group on the NCCL backend, got {backend}")
        self._group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._after = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self._before = dist.get_global_rank(group, (self.rank - 1) % self.world_size)

    def start(self, sends: tuple, recvs: tuple) -> "_TorchWorks":
        import torch
        import torch.distributed as dist

        stream = _torch_stream_of_cupy()
        with torch.cuda.stream(stream):
            ops = [dist.P2POp(dist.isend, _bytes(x), self._after, self._group) for x in sends]
            ops += [dist.P2POp(dist.irecv, _bytes(x), self._before, self._group) for x in recvs]
            return _TorchWorks(dist.batch_isend_irecv(ops), stream)


class _TorchWorks:
    def __init__(self, works, stream):
        self._works, self._stream = works, stream

    def wait(self) -> None:
        import torch

        with torch.cuda.stream(self._stream):
            for work in self._works:
                work.wait()


def _torch_stream_of_cupy():
    """CuPy's current stream as a torch stream: torch's current one when they are the same
    stream (calls with torch tensors), else a torch ExternalStream of it."""
    import cupy
    import torch

    device = cupy.cuda.Device().id
    ptr = cupy.cuda.get_current_stream().ptr
    current = torch.cuda.current_stream(device)
    if current.cuda_stream == ptr:
        return current
    return torch.cuda.ExternalStream(ptr, device=torch.device("cuda", device))


def _bytes(x):
    """A torch uint8 view of contiguous CuPy array x's bytes."""
    import cupy
    import torch

    return torch.from_dlpack(x.reshape(-1).view(cupy.uint8))


def transport_for(group) -> Transport:
    """The Transport of ``group``: a torch.distributed ProcessGroup (NCCL backend), a
    cupy.cuda.nccl.NcclCommunicator, or a Transport (returned as it is)."""
    if isinstance(group, Transport):
        return group
    kind = type(group)
    if kind.__name__ == "NcclCommunicator" and kind.__module__.startswith("cupy"):
        return NcclTransport(group)
    if framework(group) == "torch":
        import torch.distributed as dist
        if isinstance(group, dist.ProcessGroup):
            return TorchTransport(group)
    raise TypeError(f"group must be {_GROUP_KINDS}, got {kind.__module__}.{kind.__qualname__}")


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


# ---------------------------------------------------------------------------------------------
# The simulation: N ranks on one GPU


def simulate_ring_attention(q_shards, k_shards, v_shards, *, causal: bool = False,
                            softmax_scale: float | None = None, return_lse: bool = False):
    """:func:`ring_attention` of N simulated ranks on one GPU: the same schedule, each rank's
    messages copied into the next rank's buffers where NCCL would send them.

    q_shards, k_shards, v_shards: sequences of N CuPy arrays, rank r's shards at index r, all on
    one device (causal: zigzag shards, :func:`zigzag_shard`). Returns the list of each rank's
    output and, with ``return_lse``, the list of its LSEs; :func:`zigzag_unshard` (dim 1 for
    outputs, 2 for LSEs) puts causal ones back in sequence order.
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
    """:func:`ring_attention_backward` of N simulated ranks on one GPU, as
    :func:`simulate_ring_attention` runs the forward: each argument a sequence of N CuPy arrays,
    rank r's at index r (``out_shards`` and ``lse_shards`` what the simulated forward returned),
    ``deterministic`` as there. Returns (dq_shards, dk_shards, dv_shards), lists of each rank's
    gradients."""
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
