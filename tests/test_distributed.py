"""ptxattn.distributed: ring (context-parallel) attention.

CPU: zigzag sharding (round trip, chunk order, refusals); the ring schedule (every query meets
every key it may see exactly once, and every rank does the same work at every step); argument
checks on array metadata (tests/meta_array.py), before anything is launched; and the ranks'
programs themselves, with NumPy standing in for CuPy and a float64 NumPy attention for the
kernels, so that the ring's bookkeeping (rows per step, double buffers, the LSE merge, dK/dV
travelling home) is checked against attention over the whole sequence, in the simulation's
lockstep and with one thread per rank driving its own transport.

GPU: the simulation of N = 2, 3, 4, 8 ranks on one GPU (causal on zigzag shards, non-causal on
contiguous ones; GQA; head_dim 64 and 128; bf16, and fp16 on strided shards) against one-GPU
attention on the whole sequence. Tolerance, the rule of tests/test_attention.py and
tests/test_backward.py, whose checks are reused: against the FP32 reference, each result's max
error at most twice that of the same math done naively in the input precision, plus twice the
rounding noise of one value in that dtype; against ptxattn.attention and attention_backward, the
same bound on the distance (as tests/test_torch.py holds ptxattn to SDPA). The ring adds one
rounding per step (the kernels return each partial output and gradient in the input dtype
before the FP32 sums); a NumPy emulation of those bf16 roundings at these sizes kept the ring's
error under half the bound. One rank is ptxattn.attention bit for bit, through the simulation and
through the torch autograd op on a torch.distributed group of one.
"""

import concurrent.futures
import contextlib
import sys
import threading
import types

import numpy as np
import pytest

import ptxattn.distributed as dist_attn
from ptxattn.distributed import ring, simulation
from ptxattn.launchers import split_kv
from meta_array import MetaArray

# ---------------------------------------------------------------------------------------------
# Zigzag sharding


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dim", [1, 2, -1])
def test_zigzag_shard_and_unshard_round_trip(world_size, dim):
    x = np.arange(2 * 3 * 4 * 2 * world_size * 5).reshape(2, 3, 4, 2 * world_size * 5)
    x = np.moveaxis(x, -1, dim)
    shards = [dist_attn.zigzag_shard(x, world_size, rank, dim=dim) for rank in range(world_size)]
    assert all(s.shape[dim] == 10 for s in shards)
    np.testing.assert_array_equal(dist_attn.zigzag_unshard(shards, dim=dim), x)


def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r():
    sequence = np.arange(16)[None, :]  # 8 chunks of 2 positions for 4 ranks
    held = {rank: dist_attn.zigzag_shard(sequence, 4, rank)[0].tolist() for rank in range(4)}
    assert held == {0: [0, 1, 14, 15], 1: [2, 3, 12, 13], 2: [4, 5, 10, 11], 3: [6, 7, 8, 9]}


def test_zigzag_refusals():
    x = np.zeros((1, 12, 2, 4))
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        dist_attn.zigzag_shard(x, 0, 0)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size\)"):
        dist_attn.zigzag_shard(x, 2, 2)
    with pytest.raises(ValueError, match="must be a multiple of 2 \\* world_size = 8"):
        dist_attn.zigzag_shard(x, 4, 0)
    with pytest.raises(ValueError, match="dim must be an int in"):
        dist_attn.zigzag_shard(x, 2, 0, dim=4)
    with pytest.raises(ValueError, match="shards must be a non-empty sequence"):
        dist_attn.zigzag_unshard([])
    with pytest.raises(ValueError, match=r"shards\[1\] has shape \(1, 4, 2, 4\)"):
        dist_attn.zigzag_unshard([np.zeros((1, 6, 2, 4)), np.zeros((1, 4, 2, 4))])
    with pytest.raises(ValueError, match="even length along dim 1"):
        dist_attn.zigzag_unshard([np.zeros((1, 5, 2, 4))] * 2)


# ---------------------------------------------------------------------------------------------
# The schedule


def _zigzag_positions(world_size: int, chunk: int) -> list:
    """Each rank's global positions, in its shard's row order."""
    return [np.concatenate([np.arange(c * chunk, (c + 1) * chunk)
                            for c in (rank, 2 * world_size - 1 - rank)])
            for rank in range(world_size)]


def _visits(positions: list, rank: int, step) -> np.ndarray:
    """(query, key) global position pairs that a step computes, as a boolean matrix."""
    seqlen = sum(len(p) for p in positions)
    rows = positions[rank][step.query_rows]
    keys = positions[step.source][step.key_rows]
    seen = np.ones((len(rows), len(keys)), dtype=bool)
    if step.causal:  # bottom-right aligned, on local rows and keys
        diagonal = np.arange(len(rows))[:, None] + len(keys) - len(rows)
        seen = np.arange(len(keys))[None, :] <= diagonal
    visits = np.zeros((seqlen, seqlen), dtype=int)
    visits[np.ix_(rows, keys)] = seen
    return visits


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_every_visible_pair_is_computed_once_with_equal_work_per_step(world_size, causal):
    chunk = 3
    seqlen = 2 * world_size * chunk
    if causal:
        positions = _zigzag_positions(world_size, chunk)
    else:
        positions = np.split(np.arange(seqlen), world_size)
    total = np.zeros((seqlen, seqlen), dtype=int)
    work = np.zeros((world_size, world_size), dtype=int)  # (rank, step) -> scores computed
    for rank in range(world_size):
        steps = dist_attn.ring_schedule(rank, world_size, 2 * chunk, causal=causal)
        assert [s.source for s in steps] == [(rank - s) % world_size for s in range(world_size)]
        for index, step in enumerate(steps):
            visits = _visits(positions, rank, step)
            total += visits
            work[rank, index] = visits.sum()
    visible = np.tril(np.ones((seqlen, seqlen), dtype=int)) if causal else 1
    np.testing.assert_array_equal(total, np.broadcast_to(visible, total.shape))
    assert (work == work[0]).all(), work  # every rank the same work at each step
    if causal and world_size > 1:
        assert (work[:, 1:] == 2 * chunk * chunk).all()  # a c x 2c block, nothing masked


# ---------------------------------------------------------------------------------------------
# Argument checks, on metadata


class _StubTransport(dist_attn.Transport):
    """A transport that must never be used: the calls below are refused before any exchange."""

    def __init__(self, world_size=2, rank=0, device=None):
        self.world_size, self.rank, self.device = world_size, rank, device

    def start(self, sends, recvs):
        raise AssertionError("an exchange was started")


def _meta_qkv(seqlen_q=16, seqlen_k=16, device=0):
    return (MetaArray((2, seqlen_q, 4, 64), ptr=1 << 20, device=device),
            MetaArray((2, seqlen_k, 2, 64), ptr=2 << 20, device=device),
            MetaArray((2, seqlen_k, 2, 64), ptr=3 << 20, device=device))


def test_group_of_an_unknown_type_is_refused():
    with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup.*got "
                                        "builtins.object"):
        dist_attn.ring_attention(*_meta_qkv(), group=object())
    q, k, v = _meta_qkv()
    with pytest.raises(TypeError, match="group must be"):
        dist_attn.ring_attention_backward(q, q, k, v, q, None, group=None)


def test_a_transport_is_its_own_group():
    transport = _StubTransport()
    assert dist_attn.transport_for(transport) is transport


def test_a_cupy_nccl_communicator_is_recognized_by_its_type():
    """By the type's name and module, without importing cupy.cuda.nccl (which needs NCCL)."""
    communicator_type = type("NcclCommunicator", (), {
        "__module__": "cupy_backends.cuda.libs.nccl", "rank_id": lambda self: 2,
        "size": lambda self: 4, "device_id": lambda self: 1})
    transport = dist_attn.transport_for(communicator_type())
    assert isinstance(transport, dist_attn.NcclTransport)
    assert (transport.rank, transport.world_size, transport.device) == (2, 4, 1)


@contextlib.contextmanager
def _torch_group_of_one(backend: str):
    """torch.distributed's default group, of this process alone, on ``backend``."""
    pytest.importorskip("torch", reason="torch is not installed")
    import torch.distributed as dist

    if not dist.is_available() or (backend == "nccl" and not dist.is_nccl_available()):
        pytest.skip(f"torch.distributed has no {backend} backend here")
    if dist.is_initialized():
        pytest.skip("a torch.distributed process group is already initialized")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_torch_group_must_be_on_nccl():
    with _torch_group_of_one("gloo") as group:
        with pytest.raises(ValueError, match="group must be a process group on the NCCL "
                                             "backend, got gloo"):
            dist_attn.ring_attention(*_meta_qkv(), group=group)


@pytest.mark.parametrize("seqlens", [(15, 15), (16, 14)], ids=["odd", "unequal"])
def test_causal_ring_needs_zigzag_shards(seqlens):
    with pytest.raises(ValueError, match="causal ring attention takes zigzag shards"):
        dist_attn.ring_attention(*_meta_qkv(*seqlens), group=_StubTransport(), causal=True)


def test_attentions_own_checks_come_first():
    q, k, v = _meta_qkv()
    with pytest.raises(TypeError, match="causal must be a bool"):
        dist_attn.ring_attention(q, k, v, group=_StubTransport(), causal=1)
    with pytest.raises(ValueError, match="head_dim"):
        dist_attn.ring_attention(MetaArray((2, 16, 4, 36)), MetaArray((2, 16, 2, 36)),
                                 MetaArray((2, 16, 2, 36)), group=_StubTransport())


def test_arrays_on_another_device_than_the_communicators_are_refused():
    with pytest.raises(ValueError, match="communicator's device 1, got 0"):
        dist_attn.ring_attention(*_meta_qkv(), group=_StubTransport(device=1))


def _meta_shards(world_size=3, seqlen=16, **changes):
    """q, k, v shard lists of MetaArrays; ``changes`` replace single shards: {'k': (1, array)}."""
    shards = {name: [x] * world_size for name, x in zip("qkv", _meta_qkv(seqlen, seqlen))}
    for name, (rank, x) in changes.items():
        shards[name][rank] = x
    return shards["q"], shards["k"], shards["v"]


def test_simulation_refuses_shards_that_do_not_make_a_ring():
    with pytest.raises(ValueError, match=r"k_shards\[1\] has shape \(2, 12, 2, 64\)"):
        dist_attn.simulate_ring_attention(
            *_meta_shards(k=(1, MetaArray((2, 12, 2, 64), ptr=4 << 20))))
    q, k, v = _meta_shards()
    with pytest.raises(ValueError, match="one shard per rank"):
        dist_attn.simulate_ring_attention(q, k[:2], v)
    with pytest.raises(ValueError, match="at least one rank"):
        dist_attn.simulate_ring_attention([], [], [])
    with pytest.raises(TypeError, match="q_shards must be a list or tuple"):
        dist_attn.simulate_ring_attention(q[0], k, v)
    with pytest.raises(TypeError, match=r"v_shards\[2\] must be a cupy.ndarray, got numpy"):
        dist_attn.simulate_ring_attention(q, k, [*v[:2], np.zeros((2, 16, 2, 64))])
    with pytest.raises(ValueError, match=r"v_shards\[1\] must be on q_shards\[0\]'s device 0"):
        dist_attn.simulate_ring_attention(
            *_meta_shards(v=(1, MetaArray((2, 16, 2, 64), ptr=4 << 20, device=1))))
    with pytest.raises(ValueError, match=r"zigzag shards \(zigzag_shard\): q_shards and k_shards"):
        dist_attn.simulate_ring_attention(*_meta_shards(seqlen=15), causal=True)


def test_simulated_backward_checks_every_ranks_arguments():
    q, k, v = _meta_shards()
    out = [MetaArray((2, 16, 4, 64), ptr=5 << 20)] * 3
    lse = [MetaArray((2, 4, 16), "float32", ptr=6 << 20)] * 3
    bad_lse = MetaArray((2, 16, 4), "float32", ptr=6 << 20)
    with pytest.raises(ValueError, match=r"lse_shards\[2\] has shape"):
        dist_attn.simulate_ring_attention_backward(out, q, k, v, out, [*lse[:2], bad_lse])
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads_q, seqlen_q\)"):
        dist_attn.simulate_ring_attention_backward(out, q, k, v, out, [bad_lse] * 3)


# ---------------------------------------------------------------------------------------------
# The ranks' programs on NumPy


def _numpy_attention(q, k, v, causal, scale):
    """float64 attention: (out, lse, probabilities), GQA, bottom-right causal."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        hidden = np.arange(seqlen_k)[None] > np.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
        scores = np.where(hidden, -np.inf, scores)
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    probs = weights / total
    return np.einsum("bhqk,bkhd->bqhd", probs, vv), (np.log(total) + top)[..., 0], scores


def _numpy_attention_backward(dout, q, k, v, out, lse, causal, scale):
    """float64 (dq, dk, dv) from the given out and lse, as attention_backward computes them."""
    group = q.shape[2] // k.shape[2]
    kk, vv = (np.repeat(x, group, axis=2) for x in (k, v))
    scores = _numpy_attention(q, k, v, causal, scale)[2]
    probs = np.exp(scores - lse[..., None])
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = probs * (dp - (dout * out).sum(-1).transpose(0, 2, 1)[..., None])
    batch, seqlen_k, heads_kv, head_dim = k.shape

    def per_kv_head(x):
        return x.reshape(batch, seqlen_k, heads_kv, group, head_dim).sum(3)

    return (np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale,
            per_kv_head(np.einsum("bhqk,bqhd->bkhd", ds, q) * scale),
            per_kv_head(np.einsum("bhqk,bqhd->bkhd", probs, dout)))


@pytest.fixture
def numpy_ring(monkeypatch):
    """ptxattn.distributed's rank programs on NumPy arrays: NumPy as CuPy, float64 attention
    and its backward as the kernels, the merge (combine.cu) and accumulate kernels' math in
    NumPy."""
    from ptxattn import api

    fake = types.ModuleType("cupy")
    for name in ("zeros", "full", "empty", "ascontiguousarray", "logaddexp", "inf", "float32",
                 "ndarray"):
        setattr(fake, name, getattr(np, name))
    fake.cuda = types.SimpleNamespace(Device=lambda device: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def attention(q, k, v, *, causal, softmax_scale, return_lse):
        out, lse, _ = _numpy_attention(q, k, v, causal, softmax_scale)
        return out, lse.astype(np.float32)

    def attention_backward(dout, q, k, v, out, lse, *, causal, softmax_scale, deterministic):
        return _numpy_attention_backward(dout, q, k, v, out, lse, causal, softmax_scale)

    def combine(parts, lse_parts, out, lse, sinks=None):  # split_kv.combine (combine.cu)
        top = lse_parts.max(axis=0)
        bias = np.where(np.isfinite(top), top, 0.0)
        total = np.exp(lse_parts - bias).sum(axis=0)
        merged = np.where(total > 0, bias + np.log(np.where(total > 0, total, 1.0)), -np.inf)
        weights = np.where(total > 0, np.exp(lse_parts - merged), 0.0)
        weights = weights.transpose(0, 1, 3, 2)[..., None]  # (parts, batch, rows, heads, 1)
        out[...] = np.where(weights > 0, weights * parts, 0.0).sum(axis=0)
        lse[...] = merged

    def accumulate(part, acc):
        acc += part

    monkeypatch.setattr(api, "attention", attention)
    monkeypatch.setattr(api, "attention_backward", attention_backward)
    monkeypatch.setattr(split_kv, "combine", combine)
    monkeypatch.setattr(ring, "_accumulate", accumulate)


def _sharding(causal: bool, world_size: int, xp):
    """(shard, unshard) of sequences: zigzag for causal, contiguous blocks otherwise."""
    if causal:
        def shard(x, dim=1):
            return [dist_attn.zigzag_shard(x, world_size, rank, dim) for rank in range(world_size)]
        return shard, dist_attn.zigzag_unshard

    def shard(x, dim=1):
        return xp.split(x, world_size, axis=dim)

    def unshard(shards, dim=1):
        return xp.concatenate(shards, axis=dim)

    return shard, unshard


def _numpy_problem(world_size, causal):
    rng = np.random.default_rng(world_size * 2 + causal)
    seqlen = 2 * world_size * 3
    q, dout = (rng.standard_normal((2, seqlen, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, seqlen, 2, 8)) for _ in range(2))
    return q, k, v, dout


def _rank_programs(world_size, causal, q, k, v, dout):
    """The forward's and a function giving the backward's programs, one per rank."""
    shard, _ = _sharding(causal, world_size, np)
    qs, ks, vs, douts = shard(q), shard(k), shard(v), shard(dout)
    steps = [dist_attn.ring_schedule(r, world_size, qs[r].shape[1], causal=causal)
             for r in range(world_size)]
    forwards = [ring._forward(qs[r], ks[r], vs[r], steps[r], 0.3) for r in range(world_size)]

    def backwards(results):
        return [ring._backward(douts[r], qs[r], ks[r], vs[r], *results[r], steps[r], 0.3,
                                    False) for r in range(world_size)]

    return forwards, backwards


def _assert_ring_results(world_size, causal, q, k, v, dout, results, grads):
    _, unshard = _sharding(causal, world_size, np)
    out, lse, _ = _numpy_attention(q, k, v, causal, 0.3)
    np.testing.assert_allclose(unshard([o for o, _ in results]), out, atol=1e-5)
    np.testing.assert_allclose(unshard([lse for _, lse in results], dim=2), lse, atol=1e-5)
    expected = _numpy_attention_backward(dout, q, k, v, out, lse, causal, 0.3)
    for name, got, want in zip(("dq", "dk", "dv"), zip(*grads), expected):
        np.testing.assert_allclose(unshard(list(got)), want, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_rank_programs_in_lockstep_give_attention_over_the_whole_sequence(
        world_size, causal, numpy_ring):
    q, k, v, dout = _numpy_problem(world_size, causal)
    forwards, backwards = _rank_programs(world_size, causal, q, k, v, dout)
    results = simulation._run_in_lockstep(forwards, 0)
    grads = simulation._run_in_lockstep(backwards(results), 0)
    _assert_ring_results(world_size, causal, q, k, v, dout, results, grads)


class _ThreadRing(dist_attn.Transport):
    """One rank of a ring of threads: an exchange publishes the rank's sends, and once every
    rank has, copies the previous rank's into its recvs."""

    def __init__(self, rank, world_size, posted, barrier):
        self.rank, self.world_size = rank, world_size
        self._posted, self._barrier = posted, barrier

    def start(self, sends, recvs):
        self._posted[self.rank] = sends
        self._barrier.wait()
        for received, sent in zip(recvs, self._posted[(self.rank - 1) % self.world_size],
                                  strict=True):
            received[...] = sent
        self._barrier.wait()  # nobody posts again before every rank has copied
        return dist_attn.DONE


@pytest.mark.parametrize("causal", [False, True])
def test_rank_programs_on_their_own_threads_give_the_same(causal, numpy_ring):
    world_size = 3
    q, k, v, dout = _numpy_problem(world_size, causal)
    forwards, backwards = _rank_programs(world_size, causal, q, k, v, dout)
    posted, barrier = [None] * world_size, threading.Barrier(world_size, timeout=30)
    transports = [_ThreadRing(r, world_size, posted, barrier) for r in range(world_size)]

    def run_all(programs):
        with concurrent.futures.ThreadPoolExecutor(world_size) as pool:
            futures = [pool.submit(ring._run, program, transport)
                       for program, transport in zip(programs, transports)]
            return [f.result() for f in futures]

    results = run_all(forwards)
    _assert_ring_results(world_size, causal, q, k, v, dout, results, run_all(backwards(results)))


# ---------------------------------------------------------------------------------------------
# GPU: the simulation against one-GPU attention

SHAPES = {"gqa-d64": dict(batch=2, heads=(8, 2), head_dim=64, chunk=96),
          "mha-d128": dict(batch=1, heads=(4, 4), head_dim=128, chunk=64)}


def _random(shape, dtype, rng):
    import cupy
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _inputs(world_size, shape, rng):
    """bf16 q, k, v, dout over a sequence of 2 * world_size chunks."""
    batch, (heads_q, heads_kv), head_dim = shape["batch"], shape["heads"], shape["head_dim"]
    seqlen = 2 * world_size * shape["chunk"]
    shape_q, shape_kv = (batch, seqlen, heads_q, head_dim), (batch, seqlen, heads_kv, head_dim)
    return [_random(s, "bfloat16", rng) for s in (shape_q, shape_kv, shape_kv, shape_q)]


def _simulate(world_size, causal, shards, dout, *, softmax_scale=None, deterministic=False):
    """The simulated ring's out, lse, dq, dk, dv on (q, k, v) ``shards``, put back in sequence
    order."""
    import cupy

    shard, unshard = _sharding(causal, world_size, cupy)
    outs, lses = dist_attn.simulate_ring_attention(*shards, causal=causal,
                                                   softmax_scale=softmax_scale, return_lse=True)
    grads = dist_attn.simulate_ring_attention_backward(
        shard(dout), *shards, outs, lses, causal=causal, softmax_scale=softmax_scale,
        deterministic=deterministic)
    return (unshard(outs), unshard(lses, dim=2), *(unshard(g) for g in grads))


def _shards(world_size, causal, *arrays):
    import cupy

    shard, _ = _sharding(causal, world_size, cupy)
    return [shard(x) for x in arrays]


def _one_gpu(q, k, v, dout, *, causal, softmax_scale=None, deterministic=False):
    """ptxattn's out, lse, dq, dk, dv on the whole sequence."""
    import ptxattn

    out, lse = ptxattn.attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                                 return_lse=True)
    return (out, lse, *ptxattn.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                  softmax_scale=softmax_scale,
                                                  deterministic=deterministic))


def _assert_near_one_gpu(ring, one_gpu, q, k, v, dout, *, causal, softmax_scale=None):
    """max |ring - one GPU| <= 2 * max |naive - FP32| + 2 * noise for out, dq, dk, dv, and
    <= 2 * the naive LSE error + 1e-4 for the LSE (the rules the two are each held to)."""
    import cupy

    from ptxattn import reference

    options = dict(causal=causal, softmax_scale=softmax_scale)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True, **options)
    naive, naive_lse = reference.attention(q, k, v, return_lse=True, precision="input",
                                           **options)
    refs = (ref, *reference.attention_backward(dout, q, k, v, **options))
    naives = (naive, *reference.attention_backward(dout, q, k, v, precision="input",
                                                   **options))
    ring_out, ring_lse, *ring_grads = ring
    one_out, one_lse, *one_grads = one_gpu
    for name, a, b, r, n in zip(("out", "dq", "dk", "dv"), (ring_out, *ring_grads),
                                (one_out, *one_grads), refs, naives):
        noise = float(cupy.abs(r.astype(q.dtype).astype(cupy.float32) - r).max())
        naive_err = float(cupy.abs(n - r).max())
        distance = float(cupy.abs(a.astype(cupy.float32) - b.astype(cupy.float32)).max())
        assert distance <= 2 * naive_err + 2 * noise + 1e-6, (name, distance, naive_err, noise)
    naive_lse_err = float(cupy.abs(naive_lse - ref_lse).max())
    lse_distance = float(cupy.abs(ring_lse - one_lse).max())
    assert lse_distance <= 2 * naive_lse_err + 1e-4, (lse_distance, naive_lse_err)


def _assert_ring_correct(ring, one_gpu, q, k, v, dout, *, causal, softmax_scale=None):
    from test_attention import _assert_close as assert_output_close
    from test_backward import _assert_close as assert_gradients_close

    out, lse, *grads = ring
    assert out.dtype == q.dtype and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert_output_close(q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale)
    assert_gradients_close(grads, dout, q, k, v, causal=causal, softmax_scale=softmax_scale)
    _assert_near_one_gpu(ring, one_gpu, q, k, v, dout, causal=causal,
                         softmax_scale=softmax_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_simulated_ring_matches_one_gpu_attention(world_size, causal, shape, rng):
    q, k, v, dout = _inputs(world_size, SHAPES[shape], rng)
    ring = _simulate(world_size, causal, _shards(world_size, causal, q, k, v), dout)
    _assert_ring_correct(ring, _one_gpu(q, k, v, dout, causal=causal), q, k, v, dout,
                         causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_float16_shards_that_are_strided_views(causal, rng):
    """fp16, a softmax_scale, and shards that are views of one packed (batch, seqlen, 3, heads,
    head_dim) projection a rank: the K/V a rank sends are made contiguous first."""
    import cupy

    world_size, options = 3, dict(softmax_scale=0.2)
    qkv = _random((2, 2 * world_size * 80, 3, 4, 64), "float16", rng)
    q, k, v = (cupy.ascontiguousarray(qkv[:, :, i]) for i in range(3))
    dout = _random(q.shape, "float16", rng)
    (packed,) = _shards(world_size, causal, qkv)
    shards = [[p[:, :, i] for p in packed] for i in range(3)]
    assert not shards[1][0].flags.c_contiguous
    ring = _simulate(world_size, causal, shards, dout, **options)
    _assert_ring_correct(ring, _one_gpu(q, k, v, dout, causal=causal, **options), q, k, v, dout,
                         causal=causal, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_a_ring_of_one_is_attention_bit_for_bit(causal, rng):
    """One rank: one step, merged into zeros with weight 1, summed into zeros: every bit of
    attention's and (deterministic) attention_backward's results."""
    import cupy

    q, k, v, dout = _inputs(1, SHAPES["gqa-d64"], rng)
    ring = _simulate(1, causal, _shards(1, causal, q, k, v), dout, deterministic=True)
    expected = _one_gpu(q, k, v, dout, causal=causal, deterministic=True)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), ring, expected):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert bool((got.view(cupy.uint8) == want.view(cupy.uint8)).all()), name


# ---------------------------------------------------------------------------------------------
# GPU: the torch autograd op on a torch.distributed group of one


@pytest.fixture
def nccl_group_of_one():
    with _torch_group_of_one("nccl") as group:
        yield group


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_torch_ring_op_on_a_group_of_one_is_attention_bit_for_bit(causal, nccl_group_of_one,
                                                                  rng):
    import torch

    import ptxattn.torch

    generator = torch.Generator(device="cuda").manual_seed(int(rng.integers(2 ** 31)))
    q, dout = (torch.randn((2, 256, 8, 64), generator=generator, device="cuda")
               .to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn((2, 256, 2, 64), generator=generator, device="cuda").to(torch.bfloat16)
            for _ in range(2))
    results = []
    for attend in (ptxattn.torch.attention,
                   lambda *a, **o: ptxattn.torch.ring_attention(*a, group=nccl_group_of_one,
                                                                **o)):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = attend(*leaves, causal=causal, return_lse=True, deterministic=True)
        assert out.requires_grad and not lse.requires_grad
        out.backward(dout)
        results.append((out.detach(), lse, *(leaf.grad for leaf in leaves)))
    for name, over_the_ring, one in zip(("out", "lse", "dq", "dk", "dv"), results[1],
                                        results[0]):
        assert torch.equal(over_the_ring, one), name
