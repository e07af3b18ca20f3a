"""Context-parallel (ring) attention: the sequence sharded across GPUs, K/V passed rank to rank.

    import ptxattn.distributed as cp
    q, k, v = (cp.zigzag_shard(x, world_size, rank) for x in (q_all, k_all, v_all))
    out, lse = cp.ring_attention(q, k, v, group=group, causal=True, return_lse=True)
    dq, dk, dv = cp.ring_attention_backward(dout, q, k, v, out, lse, group=group, causal=True)

Each of N ranks holds a shard of q, k and v along the sequence; the results are the rank's shard
of attention over the whole sequence. ``group`` is a torch.distributed process group on the NCCL
backend (torch tensors, usually), a ``cupy.cuda.nccl.NcclCommunicator`` (CuPy arrays; NCCL from
the ``nvidia-nccl-cu13`` wheel, ``pip install ptxattn[nccl]``), or a ``Transport``
(``transport_for`` picks ``TorchTransport`` or ``NcclTransport`` for a group; ``DONE`` is the
handle of an exchange that is complete once posted). ``ptxattn.torch.ring_attention`` is the
differentiable torch form.

The ring. At step s (0 .. N-1) rank i holds the K/V shard that rank (i - s) mod N started with,
attends its queries to it, merges the partial output into an FP32 accumulator by LSE, and has
already handed the shard on: the send to rank i + 1 and the receive from rank i - 1 of the next
step's shard are posted before the step's attention and run beside it (double buffers; on a side
stream that waits for the compute stream through events). The backward walks the same ring with
the final output and LSE, so every step's ``attention_backward`` gives exact partial gradients:
dQ is summed on the rank in FP32, and dK/dV are summed in FP32 accumulators that travel with
their K/V one step behind and reach the rank that owns them after the last step.

Sharding. Non-causal attention works with any sharding (usually contiguous blocks). Causal
attention needs the zigzag sharding (``zigzag_shard``, as Megatron and ring-flash-attn shard):
the sequence cut into 2N chunks, rank r holding chunks r and 2N-1-r, so that every rank does the
same work at every step (``ring_schedule``). Every rank's shards must have the same shapes.

The schedule is written once, as a generator per rank that yields an ``Exchange`` where it
communicates (ptxattn/distributed/ring.py). ``ring_attention`` drives it with a real transport
(ptxattn/distributed/transports.py); the simulation (``simulate_ring_attention``,
``simulate_ring_attention_backward``, ptxattn/distributed/simulation.py) drives N of them in
lockstep on one GPU, with device copies for the messages. Each step's partial state is merged by
the kernel that merges split-KV partials (ptx_src/kernels/combine.cu). docs/guide/distributed.md
has the rest.

Importing this module sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 in the process's environment (NVLink multicast is never used; NCCL reads
its variable when it creates a communicator, so import this before creating one).
"""

import os

# NVLink multicast (NVLS, torch's symmetric-memory multimem) can put the GPUs of a shared host out
# of service: keep it off in this process, whatever was set before, before anything below can
# create a communicator.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

from .ring import (Exchange, RingStep, ring_attention, ring_attention_backward,  # noqa: E402
                   ring_schedule)
from .sharding import zigzag_shard, zigzag_unshard  # noqa: E402
from .simulation import simulate_ring_attention, simulate_ring_attention_backward  # noqa: E402
from .transports import DONE, NcclTransport, TorchTransport, Transport, transport_for  # noqa: E402

__all__ = ["ring_attention", "ring_attention_backward", "simulate_ring_attention",
           "simulate_ring_attention_backward", "zigzag_shard", "zigzag_unshard",
           "ring_schedule", "RingStep", "Exchange", "Transport", "NcclTransport",
           "TorchTransport", "DONE", "transport_for"]


def __dir__():
    return sorted(__all__)
