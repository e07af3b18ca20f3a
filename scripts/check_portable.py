"""GPU check of the portable mma.sync kernel: accuracy over a shape grid, then throughput.

    PYTHONPATH=$PWD python3 scripts/check_portable.py [--tiles D:M,N,W,S,B ...] [--skip-grid]

Accuracy: every case runs the portable forward (ptxattn/launchers/portable_forward.py) against
ptxattn.reference in FP32 and passes when its max error is at most twice that of the same math done naively in the input precision, plus the
rounding noise of one output value (the rule tests/test_attention.py applies). Throughput: bf16,
the table's tile and every --tiles candidate, beside torch SDPA's FlashAttention-2 backend in the
same process, median of CUDA-event-timed runs after warm-up.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np


def _random(shape, dtype, rng):
    import cupy
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


def _layout(kind, batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dtype, rng):
    """q, k, v, out in one of three memory layouts."""
    import cupy
    if kind == "contiguous":
        return (_random((batch, seqlen_q, heads_q, dim), dtype, rng),
                _random((batch, seqlen_k, heads_kv, dim), dtype, rng),
                _random((batch, seqlen_k, heads_kv, dim), dtype, rng),
                cupy.full((batch, seqlen_q, heads_q, dim), cupy.nan, dtype=dtype))
    if kind == "packed":  # q a head slice at an offset, k and v out of one (B, S, 2, H, D) tensor
        q = _random((batch, seqlen_q, heads_q + 1, dim), dtype, rng)[:, :, 1:]
        kv = _random((batch, seqlen_k, 2, heads_kv, dim), dtype, rng)
        out = cupy.full((batch, seqlen_q, heads_q, dim + 64), cupy.nan, dtype=dtype)[..., :dim]
        return q, kv[:, :, 0], kv[:, :, 1], out
    # "heads-major": (B, H, S, D) storage seen as (B, S, H, D)
    q = _random((batch, heads_q, seqlen_q, dim), dtype, rng).transpose(0, 2, 1, 3)
    k = _random((batch, heads_kv, seqlen_k, dim), dtype, rng).transpose(0, 2, 1, 3)
    v = _random((batch, heads_kv, seqlen_k, dim), dtype, rng).transpose(0, 2, 1, 3)
    out = cupy.full((batch, heads_q, seqlen_q, dim), cupy.nan, dtype=dtype).transpose(0, 2, 1, 3)
    return q, k, v, out


def check_case(case, rng, tile=None) -> tuple[bool, str, float]:
    import cupy
    from ptxattn import reference, runtime
    from ptxattn.launchers import portable_forward

    dtype, causal, dim, (seqlen_q, seqlen_k), batch, (heads_q, heads_kv), kind = case
    q, k, v, out = _layout(kind, batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dtype, rng)
    lse = cupy.full((batch, heads_q, seqlen_q), cupy.nan, dtype=cupy.float32)
    scale = 1.0 / math.sqrt(dim)
    tile = tile or portable_forward.tile_for(dim, causal, runtime.device_arch())
    portable_forward.run(q, k, v, out, lse, causal=causal, softmax_scale=scale, tile=tile)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, return_lse=True)
    naive, _ = reference.attention(q, k, v, causal=causal, return_lse=True, precision="input")
    out32 = out.astype(cupy.float32)
    finite = bool(cupy.isfinite(out32).all())
    err = float(cupy.abs(out32 - ref).max())
    naive_err = float(cupy.abs(naive - ref).max())
    noise = float(cupy.abs(ref.astype(dtype).astype(cupy.float32) - ref).max())
    visible = cupy.isfinite(ref_lse)
    lse_pattern = bool((cupy.isfinite(lse) == visible).all())
    lse_err = float(cupy.abs(cupy.where(visible, lse - ref_lse, 0)).max())
    ok = (finite and lse_pattern and err <= 2 * naive_err + 2 * noise + 1e-6 and lse_err <= 1e-3)
    text = (f"{dtype:8} causal={int(causal)} D={dim:3} Sq={seqlen_q:5} Sk={seqlen_k:5} "
            f"B={batch} H={heads_q}/{heads_kv} {kind:11} err={err:.2e} naive={naive_err:.2e} "
            f"lse_err={lse_err:.1e} {'ok' if ok else 'FAIL'}")
    return ok, text, err


def grid_cases(head_dims):
    seqlens = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
               (127, 4097), (200, 64)]
    cases = []
    for dtype in ("bfloat16", "float16"):
        for causal in (False, True):
            for dim in head_dims:
                for pair in seqlens:
                    batch = 2 if pair[0] * pair[1] < 10 ** 6 else 1
                    cases.append((dtype, causal, dim, pair, batch, (2, 2), "contiguous"))
                cases.append((dtype, causal, dim, (300, 300), 3, (8, 2), "contiguous"))
                cases.append((dtype, causal, dim, (129, 257), 2, (6, 1), "heads-major"))
                cases.append((dtype, causal, dim, (333, 333), 2, (4, 4), "packed"))
    return cases


def parse_tile(text):
    from ptxattn.launchers.portable_forward import Tile
    dim, rest = text.split(":")
    m, n, w, s, b = (int(x) for x in rest.split(","))
    return int(dim), Tile(m, n, w, s, b)


def _precompile(args):
    from ptxattn import runtime
    from ptxattn.launchers import portable_forward
    dtype, dim, causal, tile, arch = args
    t0 = time.time()
    runtime.compile(portable_forward.spec(dtype, dim, causal, tile, (arch,)), arch)
    return time.time() - t0


def bench(dim, tiles, shape):
    """Times the tiles of tiles[causal] beside torch SDPA's FlashAttention-2."""
    import cupy
    from ptxattn.tools.timing import time_ms
    from ptxattn.launchers import portable_forward
    batch, seqlen, heads = shape
    rng = np.random.default_rng(0)
    q, k, v = (_random((batch, seqlen, heads, dim), "bfloat16", rng) for _ in range(3))
    out = cupy.empty_like(q)
    lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
    scale = 1.0 / math.sqrt(dim)
    results = {}
    for causal in (False, True):
        flops = 4.0 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
        try:
            import torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention as sdpa
            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))

            def torch_run():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return sdpa(tq, tk, tv, is_causal=causal)
            ms = time_ms(torch_run, warmup=5, repeats=20, launches=5)
            ref = cupy.from_dlpack(torch_run().transpose(1, 2).contiguous())
            print(f"  D={dim} causal={int(causal)} torch-flash      {ms:7.3f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s")
            results[("torch", causal)] = flops / ms / 1e9
        except ImportError:
            ref = None
        for tile in tiles[causal]:
            def ours():
                portable_forward.run(q, k, v, out, lse, causal=causal, softmax_scale=scale, tile=tile)
            ms = time_ms(ours, warmup=5, repeats=20, launches=5)
            diff = (float(cupy.abs(out.astype(cupy.float32) - ref.astype(cupy.float32)).max())
                    if ref is not None else float("nan"))
            print(f"  D={dim} causal={int(causal)} {tile.label():22} {ms:7.3f} ms "
                  f"{flops / ms / 1e9:6.1f} TFLOP/s  max|ours-torch|={diff:.2e}")
            results[(tile, causal)] = flops / ms / 1e9
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", nargs="*", default=[], help="extra tiles to time (causal and not), D:M,N,W,S,B")
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--head-dims", default="64,128,256")
    args = parser.parse_args(argv)

    from ptxattn import runtime
    from ptxattn.launchers import portable_forward
    arch = runtime.device_arch()
    head_dims = [int(d) for d in args.head_dims.split(",")]
    extra = [parse_tile(t) for t in args.tiles]
    # dim -> causal -> tiles to time, the table's first
    tiles = {d: {c: [portable_forward.tile_for(d, c, arch)] for c in (False, True)} for d in head_dims}
    for d, t in extra:
        for c in (False, True):
            if t not in tiles[d][c]:
                tiles[d][c].append(t)

    jobs = [(dtype, d, c, t, arch) for d in tiles for c in (False, True) for t in tiles[d][c]
            for dtype in portable_forward.DTYPES]
    t0 = time.time()
    # NVRTC in fresh processes (never fork a process that has initialised CUDA) fills the
    # disk cache that runtime.load then reads.
    try:
        with ProcessPoolExecutor(max_workers=16,
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_precompile, jobs))
    except BrokenProcessPool as err:
        print(f"parallel compile failed ({err}); compiling serially")
        for job in jobs:
            _precompile(job)
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.1f} s on {arch}")

    failures = 0
    rng = np.random.default_rng(1)
    if not args.skip_grid:
        worst = {}
        for case in grid_cases(head_dims):
            ok, text, err = check_case(case, rng)
            failures += not ok
            key = (case[0], case[2])
            worst[key] = max(worst.get(key, 0.0), err)
            print(text, file=sys.stderr)
            if not ok:
                print(text)
        for (dtype, dim), err in sorted(worst.items()):
            print(f"grid max error {dtype:8} D={dim:3}: {err:.2e}")
    # each extra tile: a few awkward shapes, so a fast tile is also a correct one
    for d, t in extra:
        for case in [("bfloat16", c, d, p, 2, (4, 2), "packed") for c in (False, True)
                     for p in ((1000, 1000), (77, 300), (300, 77))]:
            ok, text, _ = check_case(case, rng, tile=t)
            failures += not ok
            if not ok:
                print(t.label(), text)
    print(f"accuracy: {failures} failures")

    shapes = {64: (8, 2048, 32), 128: (4, 2048, 32), 256: (4, 2048, 8)}
    for d in tiles:
        bench(d, tiles[d], shapes[d])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
