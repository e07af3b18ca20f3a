"""How a ring exchange's arrays move between processes: a :class:`Transport` over a CuPy NCCL
communicator or a torch.distributed process group, on a side stream beside the compute."""

from __future__ import annotations

import functools

from ..interop import framework

_GROUP_KINDS = ("a torch.distributed ProcessGroup (NCCL backend), a "
                "cupy.cuda.nccl.NcclCommunicator or a ptxattn.distributed.Transport")


class Transport:
    """How a ring exchange's arrays move between the processes of a ring.

    ``start(sends, recvs)`` sends each of ``sends`` to rank (rank + 1) mod world_size and
    receives each of ``recvs`` from rank (rank - 1) mod world_size, after the work queued so far
    on CuPy's current stream, and returns a handle whose ``wait()`` makes that stream wait for
    the transfer (:data:`DONE` where there is nothing to wait for). Subclass it to carry the
    ring over another library, or to wrap a transport (scripts/profile_distributed.py times the
    schedule with the sends skipped).

    Attributes
    ----------
    rank : int
        This process's place in the ring.
    world_size : int
        The number of ranks.
    device : int or None
        The CuPy device the transport is bound to, None if any.

    Examples
    --------
    >>> class Skipping(ptxattn.distributed.Transport):
    ...     def __init__(self, rank, world_size):
    ...         self.rank, self.world_size = rank, world_size
    ...     def start(self, sends, recvs):
    ...         return ptxattn.distributed.DONE
    """

    rank: int
    world_size: int
    device: int | None = None

    def start(self, sends: tuple, recvs: tuple):
        """Posts one exchange (the class docstring); returns its handle."""
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
    """The ring over a CuPy NCCL communicator.

    Each exchange is one NCCL group of sends and receives (as bytes), on a side stream that
    waits for the compute stream's work so far; its handle makes the compute stream wait for the
    transfer. Rank, world size and device are the communicator's.

    Parameters
    ----------
    comm : cupy.cuda.nccl.NcclCommunicator
        The communicator of the ring's ranks (NCCL from the ``nvidia-nccl-cu13`` wheel,
        ``pip install ptxattn[nccl]``).

    Examples
    --------
    >>> from cupy.cuda import nccl
    >>> comm = nccl.NcclCommunicator(world_size, unique_id, rank)
    >>> transport = ptxattn.distributed.NcclTransport(comm)
    >>> out = ptxattn.distributed.ring_attention(q, k, v, group=transport, causal=True)
    """

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
    """The ring over a torch.distributed process group on the NCCL backend.

    Each exchange is one ``batch_isend_irecv`` of byte views of the arrays, issued with CuPy's
    current stream as torch's current one, so that torch's NCCL stream waits for the work queued
    so far and the handle's wait() makes that stream wait for the transfer.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        The ring's ranks, in group rank order.

    Raises
    ------
    ValueError
        When the group's backend is not NCCL.

    Examples
    --------
    >>> import torch.distributed as dist
    >>> dist.init_process_group("nccl")
    >>> transport = ptxattn.distributed.TorchTransport(dist.group.WORLD)
    """

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
    """The :class:`Transport` that carries a ring over ``group``.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup, cupy.cuda.nccl.NcclCommunicator or Transport
        A process group on the NCCL backend (a :class:`TorchTransport`), a CuPy NCCL
        communicator (a :class:`NcclTransport`), or a Transport, returned as it is.

    Returns
    -------
    Transport
        What ring_attention and ring_attention_backward post their exchanges on.

    Raises
    ------
    TypeError
        When ``group`` is none of those.

    Examples
    --------
    >>> transport = ptxattn.distributed.transport_for(torch.distributed.group.WORLD)
    >>> transport.rank, transport.world_size
    (0, 2)
    """
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
