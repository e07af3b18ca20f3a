"""GPU check of the FP8 (e4m3) Hopper path: registers, a smoke test, and FP8 vs bf16 throughput.

    PYTHONPATH=$PWD python3 scripts/check_fp8.py [--smoke] [--quick]

1. Registers and spills of every FP8 kernel variant (ptxas report of the NVRTC build).
2. Smoke test: small FP8 attentions (every head_dim, causal or not, every descale granularity,
   GQA, large logits) against FP32 attention of the dequantized inputs, printing each error
   beside its bound (tests/test_fp8.py's rule and code; the full grid is that file).
3. Accuracy: the RMSE table of tests/test_fp8.py (per-tensor, per-block, per-block + Hadamard;
   normal and outlier inputs).
4. Throughput: FP8 attention (inputs quantized once, outside the timing, with per-(batch, head)
   descales and with per-block ones) and our own bf16 kernel on the same shapes in the same
   process, timed with ptxattn.tools.timing (the profiler's timer and FLOP count); prints TFLOP/s
   and the FP8 / bf16 ratio.
5. --sweep: candidate FP8 tile configurations (keys per tile, stages, persistent grid or not),
   each checked for correctness on a small problem, then timed.
Exits non-zero if a smoke or sweep correctness case fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys

import cupy
import numpy as np

from ptxattn import fp8, runtime
from ptxattn.launchers import hopper_forward
from ptxattn.quant import fp8 as quant_fp8
from ptxattn.tools.timing import attention_flops, time_ms

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tests_module():
    tests_dir = os.path.join(_HERE, "..", "tests")
    if tests_dir not in sys.path:  # test_fp8 imports its sibling meta_array
        sys.path.insert(0, tests_dir)
    return _load("ptxattn_test_fp8", os.path.join(tests_dir, "test_fp8.py"))


def smoke(rng) -> int:
    tests = _tests_module()
    cases = [dict(head_dim=d, causal=c, granularity="block", heads=(4, 4), seqlens=(515, 515),
                  scale=1.0) for d in fp8.HEAD_DIMS for c in (False, True)]
    cases += [dict(head_dim=128, causal=c, granularity=g, heads=(8, 2), seqlens=(300, 457),
                   scale=4.0) for g in fp8.GRANULARITIES for c in (False, True)]
    cases += [dict(head_dim=64, causal=False, granularity="head", heads=(2, 2),
                   seqlens=(513, 700), scale=8.0)]
    failures = 0
    for case in cases:
        (heads_q, heads_kv), (seqlen_q, seqlen_k) = case["heads"], case["seqlens"]
        shape_q = (2, seqlen_q, heads_q, case["head_dim"])
        shape_kv = (2, seqlen_k, heads_kv, case["head_dim"])
        q, k = (cupy.asarray(rng.standard_normal(shape, np.float32) * case["scale"])
                .astype("bfloat16") for shape in (shape_q, shape_kv))
        v = cupy.asarray(rng.standard_normal(shape_kv, np.float32)).astype("bfloat16")
        q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, case["granularity"])
        out, lse = fp8.attention(q8, k8, v8, **descales, causal=case["causal"], return_lse=True)
        e = tests.errors(q8, k8, v8, descales, out, lse, causal=case["causal"])
        ok = (e["finite"] and e["lse_pattern"] and e["err"] <= e["err_bound"]
              and e["lse_err"] <= e["lse_bound"])
        failures += not ok
        name = " ".join(f"{key}={value}" for key, value in case.items())
        print(f"{'PASS' if ok else 'FAIL'} {name}: err {e['err']:.2e} <= {e['err_bound']:.2e}, "
              f"lse {e['lse_err']:.2e} <= {e['lse_bound']:.2e}, finite={e['finite']} "
              f"lse_pattern={e['lse_pattern']}", flush=True)
    return failures


def accuracy() -> None:
    tests = _tests_module()
    rows = {"standard normal": tests.measure_accuracy(0.0),
            "0.1% outliers x10": tests.measure_accuracy(1e-3)}
    names = list(rows["standard normal"])
    print("RMSE vs FP32     " + "  ".join(f"{n:>20}" for n in names))
    for label, row in rows.items():
        print(f"{label:17}" + "  ".join(f"{row[n]:20.2e}" for n in names), flush=True)


def _inputs(rng, batch, seqlen, heads, head_dim):
    return tuple(cupy.asarray(rng.standard_normal((batch, seqlen, heads, head_dim), np.float32))
                 .astype("bfloat16") for _ in range(3))


def _fp8_launcher(q, k, v, out, lse, granularity, causal, **overrides):
    """The FP8 kernel's launch on q, k, v quantized with `granularity` (quantized here, once)."""
    batch, seqlen, heads, head_dim = q.shape
    q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, granularity)
    operands = tuple(quant_fp8.descale_operand(descales[f"{n}_descale"], batch, heads, seqlen)
                     for n in "qkv")
    return hopper_forward.launcher(q8.bytes, k8.bytes, v8.bytes, out, lse, causal=causal,
                           softmax_scale=1.0 / math.sqrt(head_dim), descales=operands, **overrides)


def _dims(cfg: dict) -> tuple:
    return (cfg["batch"], cfg["heads"], cfg["seqlen"], cfg["seqlen"], cfg["head_dim"],
            cfg["causal"])


def throughput(rng, quick: bool) -> None:
    rows = [(16384 // s, s, 2048 // d, d, c) for d in ((128,) if quick else (64, 128, 256))
            for s in ((4096, 8192) if quick else (2048, 4096, 8192, 16384)) for c in (False, True)]
    print(f"{'batch':>5} {'seqlen':>6} {'heads':>5} {'dim':>4} {'causal':>6} "
          f"{'bf16 TFLOP/s':>13} {'fp8 head':>9} {'fp8 block':>10} {'fp8/bf16':>9}")
    for batch, seqlen, heads, head_dim, causal in rows:
        cfg = dict(batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim, causal=causal)
        q, k, v = _inputs(rng, batch, seqlen, heads, head_dim)
        out = cupy.empty_like(q)
        lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
        bf16 = hopper_forward.launcher(q, k, v, out, lse, causal=causal, softmax_scale=head_dim ** -0.5)
        tf = [attention_flops(*_dims(cfg)) / time_ms(run, warmup=3, repeats=10) / 1e9 for run in
              (bf16, _fp8_launcher(q, k, v, out, lse, "head", causal),
               _fp8_launcher(q, k, v, out, lse, "block", causal))]
        print(f"{batch:5d} {seqlen:6d} {heads:5d} {head_dim:4d} {str(causal):>6} "
              f"{tf[0]:13.1f} {tf[1]:9.1f} {tf[2]:10.1f} {tf[1] / tf[0]:9.2f}", flush=True)


SWEEP = {  # (head_dim, causal) -> candidate (keys per tile, stages)
    (128, False): [(128, 2), (160, 2), (192, 2)],  # 224 keys spill since the consumers run free
    (128, True): [(128, 3), (128, 2), (192, 2)],
    (64, False): [(128, 3), (128, 4)],  # three consumer warpgroups: 128-key tiles at most
    (64, True): [(128, 3), (128, 4)],
    (256, False): [(64, 3), (64, 2)],
}


def sweep(rng) -> int:
    tests = _tests_module()
    failures = 0
    for (head_dim, causal), candidates in SWEEP.items():
        batch, seqlen, heads = 2, 8192, 2048 // head_dim
        cfg = dict(batch=batch, seqlen=seqlen, heads=heads, head_dim=head_dim, causal=causal)
        q, k, v = _inputs(rng, batch, seqlen, heads, head_dim)
        out = cupy.empty_like(q)
        lse = cupy.empty((batch, heads, seqlen), dtype=cupy.float32)
        small = _inputs(rng, 2, 1000, 2, head_dim)
        q8, k8, v8, descales = fp8.quantize_qkv(*small, "head")
        small_out = cupy.empty_like(small[0])
        small_lse = cupy.empty((2, 2, 1000), dtype=cupy.float32)
        for tiles in candidates:
            small_run = _fp8_launcher(*small, small_out, small_lse, "head", causal, tiles=tiles)
            small_run()
            e = tests.errors(q8, k8, v8, descales, small_out, small_lse, causal=causal)
            ok = e["finite"] and e["err"] <= e["err_bound"] and e["lse_err"] <= e["lse_bound"]
            failures += not ok
            row = (f"d={head_dim} causal={causal} tiles={tiles}: "
                   f"{'PASS' if ok else 'FAIL'} err {e['err']:.1e}/{e['err_bound']:.1e}")
            for persistent in (False, True):
                run = _fp8_launcher(q, k, v, out, lse, "head", causal, tiles=tiles,
                                    persistent=persistent)
                tf = attention_flops(*_dims(cfg)) / time_ms(run, warmup=2, repeats=5) / 1e9
                row += f" | {'pers' if persistent else 'grid'} {tf:6.1f}"
            print(row, flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="registers and smoke test only")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="time candidate FP8 tile configs")
    parser.add_argument("--quick", action="store_true", help="head_dim 128, seqlen 4096/8192")
    args = parser.parse_args()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"arch {runtime.device_arch()}")
    for s in hopper_forward.variants():
        if "_e4m3_" in s.name:
            r = runtime.compile(s, "sm_90a").report
            print(f"  {s.name}: " + (f"{r.registers} regs, spills {r.spill_stores}/"
                                     f"{r.spill_loads}" if r else "no ptxas report"))
    rng = np.random.default_rng(0)
    failures = smoke(rng)
    if args.sweep:
        failures += sweep(rng)
    if not args.smoke:
        if not args.skip_accuracy:
            accuracy()
        throughput(rng, args.quick)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
