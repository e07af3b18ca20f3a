"""GPU timing shared by the profiler and the tuning scripts."""

from __future__ import annotations

import random
import statistics


def time_ms(fn, warmup: int = 3, repeats: int = 15, launches: int = 10) -> float:
    """Median over ``repeats`` CUDA-event-timed samples of the mean time of ``launches``
    back-to-back calls of ``fn`` on the current stream, after ``warmup`` calls. Back-to-back
    calls let each call's host-side work overlap the previous call's GPU work, as in real use."""
    return time_ms_interleaved({None: fn}, warmup, repeats, launches)[None]


def time_ms_interleaved(fns: dict, warmup: int = 3, repeats: int = 15,
                        launches: int = 10, seed: int = 0) -> dict:
    """time_ms of each function of ``fns`` (name -> callable), sampled in turns: round r times
    every function once, in an order shuffled every round (from ``seed``, so a run repeats its
    turns). A GPU's clock follows its temperature and power draw, which the previous work set,
    so a sample inherits the state its predecessor left: timing one function after the other
    would hand each its own, and turns in a fixed order (even reversed every other round) hand
    each function the same neighbours every round. On a power-capped H100 the same kernel
    timed beside a peer read up to 8% slower than in the next place of such turns
    (docs/hopper-tuning.md, session 33); shuffled turns give every function every neighbour."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    order = list(fns.items())
    turns = random.Random(seed)
    for _ in range(repeats):
        for name, fn in turns.sample(order, len(order)):
            start.record()
            for _ in range(launches):
                fn()
            stop.record()
            stop.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, stop) / launches)
    return {name: statistics.median(samples) for name, samples in times.items()}


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """4 * B * H * Sq * Sk * D (two GEMMs of 2 flops per multiply-add), halved for causal."""
    total = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return total / 2 if causal else total
