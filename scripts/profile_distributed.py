"""Ring (context-parallel) attention across the GPUs of one host: TFLOP/s per GPU, scaling
against one GPU, the share of communication the compute hides, and a correctness check.

    torchrun --nproc-per-node N scripts/profile_distributed.py [--seqlen 131072] [--heads 32]
        [--kv-heads H] [--head-dim 128] [--batch 1] [--no-causal] [--dtype bfloat16]
        [--transport torch|cupy] [--repeats 3] [--check-seqlen 16384]

Every rank does the same work; rank 0 prints. Times are CUDA-event timed on the compute stream,
the median of --repeats samples after one warm-up, every variant taking its samples in turn with
the others (ptxattn.tools.timing); forward and backward are timed apart, fwd+bwd is their sum.

- ring: ptxattn.distributed.ring_attention, then ring_attention_backward, on the rank's shard of
  --seqlen tokens (zigzag shards when causal, contiguous ones otherwise); the slowest rank's
  time. TFLOP/s per GPU = the FLOPs of attention over the whole sequence / N / that time
  (forward 4·B·H·S²·D, halved for causal; backward 2.5 times the forward).
- one GPU: ptxattn.attention and attention_backward over the whole sequence, run by every GPU
  at once, so that each runs under the power and heat it has in the ring; their mean. Scaling
  efficiency = one-GPU time / (N x ring time): 100% when the ring adds nothing to the 1/N of
  the work each GPU does.
- communication: the same ring with the transport's sends skipped (its compute alone; results
  wrong and unused), and the ring's messages alone (the exchanges of one forward and one
  backward, recorded, then posted back to back on the real transport). Share hidden = 1 -
  (ring - compute alone) / messages alone.
- correctness: (1) at --check-seqlen tokens, the ring's output, LSE and gradients (with
  --transport torch through ptxattn.torch.ring_attention's autograd) against FP32 attention over
  the whole sequence, by the tests' rule: max error <= 2 x that of the same math done naively in
  the input precision + 2 x one rounding (LSE: 2 x naive + 1e-4). (2) at --seqlen tokens, the
  ring against one-GPU ptxattn: max |difference| <= N/2 + 2 units in the last place of the
  largest value (the ring rounds each of its N partials to the input dtype once, half a unit
  each; the two final roundings and the kernels' own summation orders make the rest), LSE
  within 1e-3 (FP32 sums of the same terms in two orders differ by about 1e-5; a wrong merge
  moves an LSE by O(1)). Each rank checks its shard and the maxima are reduced over the ranks:
  the check of the gathered arrays.

Exits 1 when a check fails or the forward + backward scaling efficiency is under 90% (issue
#19's target). NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1
are set before torch is imported: NVLink multicast is never used. Without torchrun it runs a
ring of one on the current GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

# NVLink multicast stays off: NCCL and torch read these when they create a communicator.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

# scripts/profile.py shadows the standard library's `profile`, which torch imports through
# cProfile: keep this folder off the import path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

from ptxattn import distributed  # noqa: E402  (after the path fix)

EFFICIENCY_TARGET = 0.90
PHASES = ("forward", "backward", "fwd+bwd")
BACKWARD_FLOPS = 2.5  # the backward's FLOPs over the forward's (five GEMMs against two)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=131072,
                        help="tokens in the whole sequence (rounded down to a multiple of 2N, "
                             "or N when not causal; default 131072)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads (default: --heads; fewer for GQA)")
    parser.add_argument("--head-dim", type=int, default=128, choices=[64, 128, 256])
    parser.add_argument("--no-causal", dest="causal", action="store_false",
                        help="non-causal attention (default: causal)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--transport", default="torch", choices=["torch", "cupy"],
                        help="torch: the torch.distributed NCCL process group; cupy: a "
                             "cupy.cuda.nccl communicator (default torch)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed samples of each variant (default 3)")
    parser.add_argument("--check-seqlen", type=int, default=16384,
                        help="tokens of the check against FP32 attention (default 16384)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    return args


# ---------------------------------------------------------------------------------------------
# Transports for the measurements


class SkipSends(distributed.Transport):
    """The ring's schedule with nothing sent or received: its compute alone (results wrong)."""

    def __init__(self, transport: distributed.Transport):
        self.rank, self.world_size = transport.rank, transport.world_size
        self.device = transport.device

    def start(self, sends, recvs):
        return distributed.DONE


class MessageLog(SkipSends):
    """SkipSends that keeps each exchange's arrays, to post them later on the real transport."""

    def __init__(self, transport: distributed.Transport):
        super().__init__(transport)
        self.exchanges = []

    def start(self, sends, recvs):
        self.exchanges.append((sends, recvs))
        return distributed.DONE


def posting(transport: distributed.Transport, exchanges: list):
    """A function that posts ``exchanges`` one after the other on ``transport``, each waited
    for on the compute stream before the next."""
    def post_all():
        for sends, recvs in exchanges:
            transport.start(sends, recvs).wait()
    return post_all


# ---------------------------------------------------------------------------------------------
# Set-up


def init_distributed(torch, dist) -> int:
    """torchrun's process group (NCCL), or a group of one without torchrun; returns the local
    rank, whose GPU this process uses."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        os.environ.setdefault(name, value)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return local_rank


def ring_group(kind: str, dist):
    """The ``group`` ring attention runs on: torch's process group, or a CuPy NCCL communicator
    over the same ranks (its id broadcast through torch)."""
    if kind == "torch":
        return dist.group.WORLD
    from cupy.cuda import nccl

    box = [nccl.get_unique_id() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return nccl.NcclCommunicator(dist.get_world_size(), box[0], dist.get_rank())


def usable_seqlen(requested: int, world_size: int, causal: bool) -> int:
    """``requested`` rounded down to what the sharding splits evenly: 2N zigzag chunks, or N
    contiguous shards."""
    multiple = 2 * world_size if causal else world_size
    seqlen = requested - requested % multiple
    if seqlen < multiple:
        raise SystemExit(f"a sequence of {requested} tokens does not split into {multiple} "
                         f"chunks")
    return seqlen


def whole_sequence(torch, args, seqlen: int, seed: int) -> list:
    """q, k, v and an output gradient over the whole sequence, the same on every rank."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, args.dtype)
    shape_q = (args.batch, seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, seqlen, args.kv_heads, args.head_dim)
    return [torch.randn(shape, generator=generator, device="cuda", dtype=dtype)
            for shape in (shape_q, shape_kv, shape_kv, shape_q)]


def shard(x, args, world_size: int, rank: int, dim: int = 1):
    """This rank's shard of ``x`` (torch or CuPy) along ``dim``: zigzag when causal."""
    if args.causal:
        return distributed.zigzag_shard(x, world_size, rank, dim)
    size = x.shape[dim] // world_size
    return x[(slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)]


# ---------------------------------------------------------------------------------------------
# Measurements


def ring_results(args, group, q, k, v, dout) -> tuple:
    """The ring's out, lse, dq, dk, dv on this rank: through ptxattn.torch's autograd op with the
    torch transport, through ptxattn.distributed's functions with the CuPy one."""
    if args.transport == "torch":
        import ptxattn.torch

        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = ptxattn.torch.ring_attention(*leaves, group=group, causal=args.causal,
                                                return_lse=True)
        out.backward(dout)
        return (out.detach(), lse, *(leaf.grad for leaf in leaves))
    out, lse = distributed.ring_attention(q, k, v, group=group, causal=args.causal,
                                          return_lse=True)
    return (out, lse, *distributed.ring_attention_backward(dout, q, k, v, out, lse, group=group,
                                                           causal=args.causal))


def one_gpu_results(args, q, k, v, dout) -> tuple:
    import ptxattn

    out, lse = ptxattn.attention(q, k, v, causal=args.causal, return_lse=True)
    return (out, lse, *ptxattn.attention_backward(dout, q, k, v, out, lse, causal=args.causal))


def timings(args, group, local: tuple, whole: tuple, ring: tuple, one_gpu: tuple) -> dict:
    """{(phase, variant): ms on this rank} for the forward and backward of the ring, its compute
    alone, its messages alone, and one GPU. ``local`` and ``whole`` are (q, k, v, dout): this
    rank's shards and the whole sequence; ``ring`` and ``one_gpu`` their results (out, lse,
    ...), which the backward starts from."""
    import ptxattn
    from ptxattn.tools.timing import time_ms_interleaved

    transport = distributed.transport_for(group)
    q, k, v, dout = local
    out, lse = ring[:2]
    causal = args.causal

    def forward(via):
        return lambda: distributed.ring_attention(q, k, v, group=via, causal=causal)

    def backward(via):
        return lambda: distributed.ring_attention_backward(dout, q, k, v, out, lse, group=via,
                                                           causal=causal)

    logs = {phase: MessageLog(transport) for phase in ("forward", "backward")}
    forward(logs["forward"])()
    backward(logs["backward"])()
    q1, k1, v1, dout1 = whole
    out1, lse1 = one_gpu[:2]
    skipped = SkipSends(transport)
    functions = {
        ("forward", "one GPU"): lambda: ptxattn.attention(q1, k1, v1, causal=causal),
        ("backward", "one GPU"): lambda: ptxattn.attention_backward(dout1, q1, k1, v1, out1,
                                                                    lse1, causal=causal),
        ("forward", "ring"): forward(transport),
        ("backward", "ring"): backward(transport),
        ("forward", "compute alone"): forward(skipped),
        ("backward", "compute alone"): backward(skipped),
        ("forward", "messages alone"): posting(transport, logs["forward"].exchanges),
        ("backward", "messages alone"): posting(transport, logs["backward"].exchanges),
    }
    times = time_ms_interleaved(functions, warmup=1, repeats=args.repeats, launches=1)
    for variant in ("one GPU", "ring", "compute alone", "messages alone"):
        times["fwd+bwd", variant] = times["forward", variant] + times["backward", variant]
    return times


def over_ranks(torch, dist, values: dict, op) -> dict:
    """``values`` (name -> float) reduced over the ranks with ``op`` (a dist.ReduceOp)."""
    names = list(values)
    reduced = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device="cuda")
    dist.all_reduce(reduced, op=op)
    return dict(zip(names, reduced.tolist()))


# ---------------------------------------------------------------------------------------------
# Checks


def check_against_fp32(torch, dist, args, group, seqlen: int) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) for out, lse, dq, dk, dv of the ring at ``seqlen`` tokens against
    FP32 attention over the whole sequence (the tests' rule)."""
    import cupy

    from ptxattn import reference

    world_size, rank = dist.get_world_size(), dist.get_rank()
    whole = whole_sequence(torch, args, seqlen, args.seed + 1)
    ring = ring_results(args, group, *(shard(x, args, world_size, rank) for x in whole))
    q, k, v, dout = (cupy.from_dlpack(x) for x in whole)
    options = dict(causal=args.causal)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive, naive_lse = reference.attention(q, k, v, return_lse=True, precision="input",
                                           **options)
    refs = (ref, *reference.attention_backward(dout, q, k, v, **options))
    naives = (naive, *reference.attention_backward(dout, q, k, v, precision="input", **options))
    measured = {}
    got = (ring[0], *ring[2:])
    for name, ours, r, n in zip(("out", "dq", "dk", "dv"), got, refs, naives):
        r, n = shard(r, args, world_size, rank), shard(n, args, world_size, rank)
        ours = cupy.from_dlpack(ours).astype(cupy.float32)
        measured[f"{name} err"] = float(cupy.abs(ours - r).max())
        measured[f"{name} naive"] = float(cupy.abs(n - r).max())
        measured[f"{name} noise"] = float(cupy.abs(r.astype(q.dtype).astype(cupy.float32) - r)
                                          .max())
        measured[f"{name} nonfinite"] = float(not bool(cupy.isfinite(ours).all()))
    ref_lse, naive_lse = (shard(x, args, world_size, rank, dim=2) for x in (ref_lse, naive_lse))
    measured["lse err"] = float(cupy.abs(cupy.from_dlpack(ring[1]) - ref_lse).max())
    measured["lse naive"] = float(cupy.abs(naive_lse - ref_lse).max())
    worst = over_ranks(torch, dist, measured, dist.ReduceOp.MAX)
    results = []
    for name in ("out", "dq", "dk", "dv"):
        err, naive_err, noise = (worst[f"{name} {part}"] for part in ("err", "naive", "noise"))
        bound = 2 * naive_err + 2 * noise + 1e-6
        passed = err <= bound and not worst[f"{name} nonfinite"]
        results.append((name, passed, f"max err {err:.2e} <= {bound:.2e} (naive {naive_err:.2e},"
                                      f" noise {noise:.2e})"))
    bound = 2 * worst["lse naive"] + 1e-4
    results.append(("lse", worst["lse err"] <= bound,
                    f"max err {worst['lse err']:.2e} <= {bound:.2e}"))
    return results


def ulp(value: float, dtype: str) -> float:
    """One unit in the last place of ``value`` in the 16-bit ``dtype``."""
    import ml_dtypes
    import numpy as np

    if value <= 0:
        return 0.0
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) * 2.0 ** math.floor(math.log2(value))


def check_against_one_gpu(torch, dist, args, ring: tuple, one_gpu: tuple
                          ) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) for out, lse, dq, dk, dv: this rank's ring results against its
    shard of one-GPU ptxattn's, within N/2 + 2 units in the last place of the largest value
    (LSE: 1e-3)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    names = ("out", "lse", "dq", "dk", "dv")
    measured = {}
    for name, ours, whole in zip(names, ring, one_gpu):
        theirs = shard(whole, args, world_size, rank, dim=2 if name == "lse" else 1).float()
        measured[f"{name} distance"] = float((ours.float() - theirs).abs().max())
        measured[f"{name} largest"] = float(whole.float().abs().max())
    worst = over_ranks(torch, dist, measured, dist.ReduceOp.MAX)
    ulps = world_size / 2 + 2
    results = []
    for name in names:
        distance = worst[f"{name} distance"]
        bound = 1e-3 if name == "lse" else ulps * ulp(worst[f"{name} largest"], args.dtype)
        results.append((name, distance <= bound, f"max |ring - one GPU| {distance:.2e} <= "
                                                 f"{bound:.2e}"))
    return results


# ---------------------------------------------------------------------------------------------
# Report


def report(args, world_size: int, device: str, seqlen: int, times: dict, one_gpu_ms: dict,
           checks: dict) -> bool:
    """Prints the summary; returns whether every check passed and the target was met."""
    from ptxattn.tools.timing import attention_flops

    forward = attention_flops(args.batch, args.heads, seqlen, seqlen, args.head_dim,
                              args.causal)
    flops = {"forward": forward, "backward": BACKWARD_FLOPS * forward,
             "fwd+bwd": (1 + BACKWARD_FLOPS) * forward}
    print(f"ring attention: {world_size} x {device}, transport {args.transport}, "
          f"{'causal (zigzag shards)' if args.causal else 'non-causal (contiguous shards)'}, "
          f"{seqlen} tokens ({seqlen // world_size} a GPU), batch {args.batch}, heads "
          f"{args.heads}/{args.kv_heads}, head_dim {args.head_dim}, {args.dtype}")
    print(f"{'':24}" + "".join(f"{phase:>27}" for phase in PHASES))
    rows = (("one GPU, whole sequence", one_gpu_ms, 1),
            ("ring, per GPU", times["ring"], world_size),
            ("ring, compute alone", times["compute alone"], world_size))
    for label, ms, share in rows:
        cells = [f"{ms[p]:9.2f} ms {flops[p] / share / ms[p] / 1e9:6.1f} TF/s" for p in PHASES]
        print(f"{label:24}" + "".join(f"{c:>27}" for c in cells))
    print(f"{'ring, messages alone':24}" + "".join(f"{times['messages alone'][p]:>24.2f} ms"
                                                   for p in PHASES))
    efficiency = {p: one_gpu_ms[p] / (world_size * times["ring"][p]) for p in PHASES}
    print(f"scaling efficiency (one-GPU time / ({world_size} x ring time)): "
          + ", ".join(f"{p} {efficiency[p]:.1%}" for p in PHASES)
          + f"  [target fwd+bwd >= {EFFICIENCY_TARGET:.0%}: "
          + ("met]" if efficiency["fwd+bwd"] >= EFFICIENCY_TARGET else "NOT met]"))
    hidden = []
    for p in PHASES:
        messages = times["messages alone"][p]
        exposed = max(0.0, times["ring"][p] - times["compute alone"][p])
        share = 1 - min(exposed, messages) / messages if messages > 0 else 1.0
        hidden.append(f"{p} {share:.0%} ({exposed:.2f} of {messages:.2f} ms exposed)")
    print("communication hidden behind compute: " + ", ".join(hidden))
    passed = efficiency["fwd+bwd"] >= EFFICIENCY_TARGET
    for title, results in checks.items():
        print(f"correctness, {title}: " + ("PASS" if all(ok for _, ok, _ in results)
                                           else "FAIL"))
        for name, ok, detail in results:
            print(f"  {name:4} {'ok  ' if ok else 'FAIL'} {detail}")
            passed = passed and ok
    return passed


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("profile_distributed.py: needs torch (torchrun starts it)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("profile_distributed.py: no CUDA GPU is visible; nothing to measure.",
              file=sys.stderr)
        return 2
    import cupy

    local_rank = init_distributed(torch, dist)
    cupy.cuda.Device(local_rank).use()
    # The timing events go on CuPy's current stream, the ring's work on torch's: the same one.
    assert torch.cuda.current_stream().cuda_stream == cupy.cuda.get_current_stream().ptr
    world_size, rank = dist.get_world_size(), dist.get_rank()
    group = ring_group(args.transport, dist)
    seqlen = usable_seqlen(args.seqlen, world_size, args.causal)
    check_seqlen = usable_seqlen(args.check_seqlen, world_size, args.causal)

    checks = {f"{check_seqlen} tokens against FP32 attention":
              check_against_fp32(torch, dist, args, group, check_seqlen)}
    cupy.get_default_memory_pool().free_all_blocks()  # the FP32 reference's, for torch's use
    whole = whole_sequence(torch, args, seqlen, args.seed)
    local = tuple(shard(x, args, world_size, rank) for x in whole)
    ring = ring_results(args, group, *local)
    one_gpu = one_gpu_results(args, *whole)
    checks[f"{seqlen} tokens against one-GPU ptxattn"] = check_against_one_gpu(
        torch, dist, args, ring, one_gpu)
    times = timings(args, group, local, whole, ring, one_gpu)
    slowest = over_ranks(torch, dist, {f"{p}|{v}": ms for (p, v), ms in times.items()},
                         dist.ReduceOp.MAX)
    summed = over_ranks(torch, dist, {p: times[p, "one GPU"] for p in PHASES},
                        dist.ReduceOp.SUM)
    by_variant = {}
    for key, ms in slowest.items():
        phase, variant = key.split("|")
        by_variant.setdefault(variant, {})[phase] = ms
    one_gpu_ms = {p: summed[p] / world_size for p in PHASES}
    passed = True
    if rank == 0:
        passed = report(args, world_size, torch.cuda.get_device_name(), seqlen, by_variant,
                        one_gpu_ms, checks)
    passed = bool(over_ranks(torch, dist, {"failed": not passed}, dist.ReduceOp.MAX)["failed"]
                  == 0)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
