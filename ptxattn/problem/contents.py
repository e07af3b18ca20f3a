"""The checks that read array contents, not only metadata: each copies to the host (a
synchronization), so the serving entry points run them only with ``check_contents=True``."""

from __future__ import annotations

import numbers

import numpy as np

def check_kvcache_contents(problem, cache_seqlens, block_table,
                           num_pages: int, seqlen_new: int) -> None:
    """The values a kv-cache call's metadata checks cannot see (one device-to-host copy):
    lengths within the cache and the page table's used entries naming real pages."""
    lengths = (np.full(problem.batch, cache_seqlens, dtype=np.int64)
               if isinstance(cache_seqlens, numbers.Integral)
               else cache_seqlens.get().astype(np.int64))
    if (lengths < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {lengths.min()} for sequence "
                         f"{int(np.argmin(lengths))}")
    total = lengths + seqlen_new
    if (total > problem.seqlen_k).any():
        b = int(np.argmax(total))
        raise ValueError(f"cache_seqlens + seqlen_new must not exceed the cache's capacity of "
                         f"{problem.seqlen_k} keys, got {int(total[b])} for sequence {b}")
    if block_table is None:
        return
    page_size = problem.seqlen_k // block_table.shape[1]
    table = block_table.get()
    used = -(-total // page_size)
    for b in range(problem.batch):
        pages = table[b, :used[b]]
        bad = pages[(pages < 0) | (pages >= num_pages)]
        if bad.size:
            raise ValueError(f"block_table[{b}] names page {int(bad[0])} among its first "
                             f"{int(used[b])} (the pages sequence {b} uses); pages must be in "
                             f"[0, {num_pages})")


def check_varlen_contents(problem, cu_seqlens_q, cu_seqlens_k,
                          total_k: int) -> None:
    """cu_seqlens that start at 0, never decrease, end at the token counts and stay within the
    given maxima (one device-to-host copy)."""
    for name, cu, total, most in (("cu_seqlens_q", cu_seqlens_q, problem.total_q,
                                   problem.seqlen_q),
                                  ("cu_seqlens_k", cu_seqlens_k, total_k, problem.seqlen_k)):
        values = cu.get().astype(np.int64)
        lengths = np.diff(values)
        if values[0] != 0 or (lengths < 0).any() or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the number of "
                             f"tokens ({total}), got {values.tolist()[:8]}"
                             f"{'...' if len(values) > 8 else ''} ending at {int(values[-1])}")
        if lengths.max() > most:
            raise ValueError(f"{name} holds a sequence of {int(lengths.max())} tokens, more "
                             f"than max_seqlen_{name[-1]} = {most}")
