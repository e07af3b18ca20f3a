"""GPU check of the Hopper forward kernel: correctness grid, timing beside cuDNN, SASS.

    PYTHONPATH=$PWD python3 scripts/check_hopper.py [--skip-grid] [--skip-timing]

1. Correctness: random inputs over dtype x causal x head_dim x (seqlen_q, seqlen_k), plus GQA,
   MQA, batch > 1, non-contiguous q/k/v/out, against the FP32 CuPy reference. A case passes when
   the kernel's max error is at most twice that of the same math done naively in the input
   precision (plus one rounding step of the output), LSE likewise; every case prints its errors.
2. Timing (bf16): median of CUDA-event-timed runs after warm-up, beside torch SDPA's cuDNN
   backend measured in the same process.
3. SASS: the bf16 head_dim-128 cubin disassembled with cuobjdump; HGMMA instructions counted.
Exits non-zero if any correctness case fails.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile

import cupy
import numpy as np

from ptxattn import reference, runtime
from ptxattn.launchers import hopper_forward
from ptxattn.problem import AttentionProblem
from ptxattn.tools.timing import time_ms

SEQLEN_PAIRS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000),
                (1000, 17), (127, 4097), (300, 129)]


def random(shape, dtype, rng, scale=1.0):
    return cupy.asarray(rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)


def problem(batch, seqlen, heads, head_dim, rng):
    """Random bf16 q, k, v of one shape, and an output and LSE buffer for them."""
    q, k, v = (random((batch, seqlen, heads, head_dim), "bfloat16", rng) for _ in range(3))
    return q, k, v, cupy.empty_like(q), cupy.empty((batch, heads, seqlen), dtype=cupy.float32)


def check(q, k, v, *, causal, softmax_scale=None, out=None, **launch) -> tuple[bool, str]:
    checked = AttentionProblem.from_16bit(q, k, v, out=out, softmax_scale=softmax_scale)
    scale = checked.softmax_scale
    if out is None:
        out = cupy.full(q.shape, cupy.nan, dtype=q.dtype)
    lse = cupy.full((q.shape[0], q.shape[2], q.shape[1]), cupy.nan, dtype=cupy.float32)
    hopper_forward.run(q, k, v, out, lse, causal=causal, softmax_scale=scale, **launch)
    ref, ref_lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale,
                                       return_lse=True)
    naive, naive_lse = reference.attention(q, k, v, causal=causal, softmax_scale=scale,
                                           return_lse=True, precision="input")
    out32 = out.astype(cupy.float32)
    noise = float(cupy.abs(ref.astype(q.dtype).astype(cupy.float32) - ref).max())
    diff = cupy.abs(out32 - ref)
    finite = bool(cupy.isfinite(out32).all())
    err = float(cupy.nan_to_num(diff, nan=1e9).max())
    naive_err = float(cupy.abs(naive - ref).max())
    visible = cupy.isfinite(ref_lse)
    lse_pattern = bool((cupy.isfinite(lse) == visible).all())
    lse_err = float(cupy.nan_to_num(cupy.abs(cupy.where(visible, lse - ref_lse, 0)), nan=1e9).max())
    naive_lse_err = float(cupy.abs(cupy.where(visible, naive_lse - ref_lse, 0)).max())
    ok = (finite and err <= 2 * naive_err + 2 * noise + 1e-6 and lse_pattern
          and lse_err <= 2 * naive_lse_err + 1e-4)
    text = (f"err {err:.2e} (naive {naive_err:.2e}) lse_err {lse_err:.2e} "
            f"(naive {naive_lse_err:.2e}) finite={finite} lse_pattern={lse_pattern}")
    if not ok:
        bad_rows = cupy.argwhere(cupy.nan_to_num(diff, nan=1e9).max(axis=-1)
                                 > 2 * naive_err + 2 * noise + 1e-6)
        text += (f"  bad (b,s,h) rows: {len(bad_rows)} of {q.shape[0] * q.shape[1] * q.shape[2]},"
                 f" first {bad_rows[:4].get().tolist()}")
    return ok, text


def correctness_grid(rng) -> int:
    failures = 0

    def report(name, result):
        nonlocal failures
        ok, text = result
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {text}", flush=True)

    for dtype in ("bfloat16", "float16"):
        for causal in (False, True):
            for head_dim in hopper_forward.HEAD_DIMS:
                for seqlen_q, seqlen_k in SEQLEN_PAIRS:
                    batch = 2 if seqlen_q * seqlen_k < 10 ** 6 else 1
                    q = random((batch, seqlen_q, 2, head_dim), dtype, rng)
                    k = random((batch, seqlen_k, 2, head_dim), dtype, rng)
                    v = random((batch, seqlen_k, 2, head_dim), dtype, rng)
                    report(f"{dtype} causal={causal} d={head_dim} b={batch} "
                           f"sq={seqlen_q} sk={seqlen_k}", check(q, k, v, causal=causal))
    for heads_q, heads_kv in ((8, 2), (6, 1)):
        for causal in (False, True):
            for head_dim in hopper_forward.HEAD_DIMS:
                q = random((3, 300, heads_q, head_dim), "bfloat16", rng)
                k = random((3, 257, heads_kv, head_dim), "bfloat16", rng)
                v = random((3, 257, heads_kv, head_dim), "bfloat16", rng)
                report(f"gqa {heads_q}/{heads_kv} causal={causal} d={head_dim}",
                       check(q, k, v, causal=causal))
    for causal in (False, True):
        packed = random((2, 333, 3, 4, 128), "float16", rng)
        q, k, v = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
        big_out = cupy.full((2, 333, 8, 128), cupy.nan, dtype=cupy.float16)
        out = big_out[:, :, 1::2]
        ok, text = check(q, k, v, causal=causal, softmax_scale=0.3, out=out)
        untouched = bool(cupy.isnan(big_out[:, :, 0::2]).all())
        report(f"non-contiguous q/k/v/out causal={causal}", (ok and untouched,
                                                             f"{text} untouched={untouched}"))
    for sections in (1, 3, 5):  # 5 (batch, head) pairs: a partial last section for 3
        q = random((5, 700, 1, 128), "bfloat16", rng)
        k = random((5, 555, 1, 128), "bfloat16", rng)
        v = random((5, 555, 1, 128), "bfloat16", rng)
        report(f"tile order sections={sections}", check(q, k, v, causal=True, sections=sections))
    # Few blocks striding over many tiles: the K/V ring and Q hand-over run across tiles,
    # including tiles that see no key (causal, seqlen_q > seqlen_k) and both tile orders.
    for head_dim in hopper_forward.HEAD_DIMS:
        for causal in (False, True):
            for seqlen_q, seqlen_k in ((1000, 300), (300, 1000), (513, 513)):
                q = random((2, seqlen_q, 4, head_dim), "float16", rng)
                k = random((2, seqlen_k, 2, head_dim), "float16", rng)
                v = random((2, seqlen_k, 2, head_dim), "float16", rng)
                for blocks, sections in ((3, 1), (7, 3), (1, None)):
                    report(f"persistent blocks={blocks} sections={sections} d={head_dim} "
                           f"causal={causal} sq={seqlen_q} sk={seqlen_k}",
                           check(q, k, v, causal=causal, grid_blocks=blocks, sections=sections))
    q = random((1, 513, 2, 64), "bfloat16", rng, scale=8.0)
    k = random((1, 700, 2, 64), "bfloat16", rng, scale=8.0)
    v = random((1, 700, 2, 64), "bfloat16", rng)
    report("large logits", check(q, k, v, causal=False))
    return failures


def timing(rng) -> None:
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        torch = None
    shapes = [(4, 2048, 32, 128, False), (4, 2048, 32, 128, True), (2, 8192, 16, 128, False),
              (2, 8192, 16, 128, True), (8, 2048, 32, 64, False), (8, 2048, 32, 64, True),
              (8, 2048, 8, 256, False), (8, 2048, 8, 256, True)]
    print(f"{'shape':34s} {'ptxattn':>16s} {'cuDNN':>16s} {'ratio':>6s}")
    for batch, seqlen, heads, head_dim, causal in shapes:
        flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        q, k, v, out, lse = problem(batch, seqlen, heads, head_dim, rng)
        scale = 1.0 / math.sqrt(head_dim)
        ours = time_ms(hopper_forward.launcher(q, k, v, out, lse, causal=causal, softmax_scale=scale),
                       warmup=5)
        ours_tf = flops / ours / 1e9
        peer = "n/a"
        ratio = ""
        if torch is not None:
            tq, tk, tv = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v))
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    peer_ms = time_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        tq, tk, tv, is_causal=causal), warmup=5)
                peer_tf = flops / peer_ms / 1e9
                peer = f"{peer_tf:7.1f} TFLOP/s"
                ratio = f"{ours_tf / peer_tf:.3f}"
            except RuntimeError as err:
                peer = f"error: {str(err).splitlines()[0][:40]}"
        name = f"B={batch} S={seqlen} H={heads} D={head_dim} {'causal' if causal else 'full'}"
        print(f"{name:34s} {ours_tf:7.1f} TFLOP/s {peer:>16s} {ratio:>6s}", flush=True)


def sass(specs, show=0) -> None:
    """HGMMA and local-memory (spill) instruction counts of each variant's SASS."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        print("SASS: cuobjdump not found")
        return
    for kernel_spec in specs:
        compiled = runtime.compile(kernel_spec, "sm_90a")
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(compiled.cubin)
        text = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        os.unlink(f.name)
        lines = text.splitlines()
        hgmma = [l for l in lines if "HGMMA" in l]
        print(f"SASS {compiled.spec.name}: {len(hgmma)} HGMMA, "
              f"{sum('WARPGROUP' in l for l in lines)} WARPGROUP.*, "
              f"{sum(' LDL' in l or ' STL' in l for l in lines)} LDL/STL (spills)")
        for line in hgmma[:show]:
            print("   ", line.strip())


SWEEP = {  # (head_dim, causal) -> candidate (keys per tile, stages); shapes as in timing()
    (128, False): [(128, 2), (128, 3), (176, 2)],
    (128, True): [(128, 2), (128, 3), (176, 2)],
    (64, False): [(128, 2), (128, 3)],  # head_dim 64 tiles have three consumer warpgroups
    (64, True): [(128, 2), (128, 3)],
    (256, False): [(64, 2), (80, 2)],
    (256, True): [(64, 2), (80, 2)],
}


def sweep(rng) -> int:
    """Checks then times candidate tile configurations and both tile orders (bf16)."""
    failures = 0
    specs = [hopper_forward.spec("bfloat16", d, c, t) for (d, c), ts in SWEEP.items() for t in ts]
    sass(specs)
    for (head_dim, causal), candidates in SWEEP.items():
        batch, heads = (4, 32) if head_dim == 128 else (8, 2048 // head_dim)
        seqlen = 2048
        flops = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
        q, k, v, out, lse = problem(batch, seqlen, heads, head_dim, rng)
        small = [random((2, 1000, 2, head_dim), "bfloat16", rng) for _ in range(3)]
        for tiles in candidates:
            ok, text = check(*small, causal=causal, tiles=tiles)
            failures += not ok
            row = f"d={head_dim} causal={causal} tiles={tiles}: {'PASS' if ok else 'FAIL ' + text}"
            for persistent in (False, True):
                for sections in (1, None):
                    ms = time_ms(hopper_forward.launcher(
                        q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5,
                        tiles=tiles, sections=sections, persistent=persistent), warmup=5)
                    row += (f" | {'pers' if persistent else 'grid'} sec={sections or 'auto'}: "
                            f"{flops / ms / 1e9:5.1f}")
            print(row, flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-grid", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time candidate tile configs")
    args = parser.parse_args()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"arch {runtime.device_arch()}")
    for s in hopper_forward.variants():
        r = runtime.compile(s, "sm_90a").report
        print(f"  {s.name}: {r.registers} regs, spills {r.spill_stores}/{r.spill_loads}")
    rng = np.random.default_rng(0)
    failures = 0 if args.skip_grid else correctness_grid(rng)
    print(f"correctness failures: {failures}", flush=True)
    sass([hopper_forward.spec("bfloat16", 128, causal) for causal in (False, True)], show=2)
    if not args.skip_timing:
        timing(rng)
    if args.sweep:
        failures += sweep(rng)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
