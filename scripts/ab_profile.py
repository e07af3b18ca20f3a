"""Forward throughput of this checkout beside another one, interleaved in one process.

    python scripts/ab_profile.py --before DIR [--quick] [--rows BxSxHxD[c],...]
                                 [--families hopper,fp8-head,portable] [--json FILE]

DIR is another checkout of ptxattn (for example ``git worktree add DIR <commit>``); its package
is imported as ``ptxattn_before``, so both versions run in the same process on the same inputs,
timed in alternating rounds (ptxattn.tools.timing.time_ms_interleaved): the way to show that a
restructure costs no speed. Both run the built-in tile schedules (PTXATTN_TUNE_TABLE=builtin),
so that a tuning table on this machine does not make the comparison one of schedules; --tuned
lets the current checkout read its tables. Rows are the profiler's (ptxattn/tools/profile.py);
each family (Hopper bf16, Hopper FP8 with head scales, portable) is called through its entry point in both
versions. Prints TFLOP/s of both and the ratio after / before.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
sys.path.insert(0, _HERE + "/..")

import ptxattn  # noqa: E402
from ptxattn.tools.timing import time_ms_interleaved  # noqa: E402

from ptxattn.tools.profile import configs, flops  # noqa: E402  the profiler's rows, FLOP count


def import_checkout(root: str, name: str):
    """The ptxattn package of the checkout at ``root``, imported as ``name``."""
    package = Path(root) / "ptxattn"
    spec = importlib.util.spec_from_file_location(name, package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def runners(pkg, name: str, arch: str) -> dict:
    """family -> callable(q, k, v, causal) of one version, through its entry points (into
    buffers kept per shape, so that both versions do the same host work)."""
    import cupy

    fp8 = importlib.import_module(f"{name}.fp8")
    buffers = {}

    def outputs(q):
        key = q.shape
        if key not in buffers:
            buffers[key] = (cupy.empty_like(q),
                            cupy.empty((q.shape[0], q.shape[2], q.shape[1]), cupy.float32))
        return buffers[key]

    def family(backend):
        def run(q, k, v, causal):
            out, lse = outputs(q)
            pkg.attention(q, k, v, causal=causal, out=out, lse=lse, backend=backend)
        return run

    quantized = {}

    def fp8_head(q, k, v, causal):
        key = (q.data.ptr, k.data.ptr)
        if key not in quantized:
            quantized.clear()
            quantized[key] = fp8.quantize_qkv(q, k, v, granularity="head")
        q8, k8, v8, descales = quantized[key]
        fp8.attention(q8, k8, v8, **descales, causal=causal)

    found = {"portable": family("portable")}
    if arch == "sm_90a":
        found["hopper"] = family("hopper")
        found["fp8-head"] = fp8_head
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the other checkout's root")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the rows to this JSON file")
    parser.add_argument("--rows", help="only these rows of the sweep, as BxSxHxD with a 'c' "
                                       "suffix for causal, comma-separated (e.g. 4x4096x16x128c)")
    parser.add_argument("--families", help="only these families, comma-separated (hopper, "
                                           "fp8-head, portable)")
    parser.add_argument("--tuned", action="store_true",
                        help="let the current checkout take its schedules from the tuning tables")
    args = parser.parse_args(argv)
    if not args.tuned:
        os.environ["PTXATTN_TUNE_TABLE"] = "builtin"

    import cupy

    from ptxattn.runtime import device_arch

    arch = device_arch()
    before = import_checkout(args.before, "ptxattn_before")
    versions = {"before": runners(before, "ptxattn_before", arch),
                "after": runners(ptxattn, "ptxattn", arch)}
    families = list(versions["after"])
    if args.families:
        unknown = set(args.families.split(",")) - set(families)
        if unknown:
            parser.error(f"--families: {sorted(unknown)} not among {families}")
        families = [f for f in families if f in args.families.split(",")]
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    print(f"# {props['name'].decode()} ({arch}), bf16 (FP8: e4m3, head scales), TFLOP/s, "
          f"median of {args.repeats}, before/after interleaved")
    rows = []
    wanted = set(args.rows.split(",")) if args.rows else None
    for index, cfg in enumerate(configs(args.quick), 1):
        shape = (cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["head_dim"])
        if wanted is not None and ("x".join(map(str, shape)) + "c" * cfg["causal"]) not in wanted:
            continue
        rng = cupy.random.default_rng(index)
        q, k, v = (rng.standard_normal(shape, dtype=cupy.float32).astype(cupy.dtype("bfloat16"))
                   for _ in range(3))
        row = dict(cfg)
        # One family at a time, its two versions in alternating turns: each sees the other's
        # heat, and no version always runs behind a heavier or a lighter kernel.
        for family in families:
            calls = {version: (lambda run=found[family]: run(q, k, v, cfg["causal"]))
                     for version, found in versions.items()}
            for version, ms in time_ms_interleaved(calls, repeats=args.repeats).items():
                row[f"{family}:{version}"] = flops(cfg) / ms / 1e9
        rows.append(row)
        cells = "  ".join(f"{f} {row[f + ':before']:6.1f} -> {row[f + ':after']:6.1f} "
                          f"({row[f + ':after'] / row[f + ':before']:.3f}x)" for f in families)
        print(f"{shape} causal={cfg['causal']!s:5}  {cells}", flush=True)
    worst = {f: min(r[f + ":after"] / r[f + ":before"] for r in rows) for f in families}
    print("worst after/before: " + ", ".join(f"{f} {w:.3f}x" for f, w in worst.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props["name"].decode(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
