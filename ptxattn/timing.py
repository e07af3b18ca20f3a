"""GPU timing shared by the profiler and the tuning scripts."""

from __future__ import annotations

import statistics


def time_ms(fn, warmup: int = 3, repeats: int = 15, launches: int = 10) -> float:
    """Median over ``repeats`` CUDA-event-timed samples of the mean time of ``launches``
    back-to-back calls of ``fn`` on the current stream, after ``warmup`` calls. Back-to-back
    calls let each call's host-side work overlap the previous call's GPU work, as in real use."""
    import cupy

    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record()
        for _ in range(launches):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / launches)
    return statistics.median(times)


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """4 * B * H * Sq * Sk * D (two GEMMs of 2 flops per multiply-add), halved for causal."""
    total = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return total / 2 if causal else total
