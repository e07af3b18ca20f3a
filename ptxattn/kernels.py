"""Compile every kernel variant ptxattn ships for one architecture and report its budget.

    python -m ptxattn.kernels --arch sm_90a [--json]

Needs no GPU. Exits non-zero if any variant fails to compile, spills registers, needs more
shared memory than one block may have on that architecture, or has its wgmmas serialized by
ptxas (which it does, silently but for a log line, when it cannot prove a kernel's
asynchronous wgmmas safe: the kernel then runs far slower).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor

from . import archs, runtime

# Every module that ships kernels; each has variants() -> list[KernelSpec].
FAMILY_MODULES = ("ptxattn.portable", "ptxattn.backward", "ptxattn.decode", "ptxattn.hopper",
                  "ptxattn.fp8", "ptxattn.blockscaled", "ptxattn.quant")
# ptxas's info line (C7510-C7520) when it makes every wgmma of a kernel wait for the previous.
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def all_variants(arch: str) -> list[runtime.KernelSpec]:
    specs = []
    for name in FAMILY_MODULES:
        specs += [s for s in importlib.import_module(name).variants() if arch in s.archs]
    return specs


def _row(spec: runtime.KernelSpec, arch: str) -> dict:
    try:
        compiled = runtime.compile(spec, arch)
        return {"name": spec.name, "arch": arch, "registers": compiled.reported().registers,
                "spill_bytes": compiled.spill_bytes, "smem_bytes": compiled.smem_bytes,
                "wgmma_serialized": WGMMA_SERIALIZED in compiled.log}
    except runtime.CompileError as err:
        return {"name": spec.name, "arch": arch, "error": err.log}
    except runtime.PtxattnError as err:  # compiled, but this NVRTC gave no ptxas report
        return {"name": spec.name, "arch": arch, "error": str(err)}


def _problems(row: dict) -> list[str]:
    if "error" in row:
        return ["does not compile, or has no ptxas report"]
    found = []
    if row["spill_bytes"]:
        found.append(f"spills {row['spill_bytes']} bytes")
    limit = archs.SMEM_LIMIT_BYTES[row["arch"]]
    if row["smem_bytes"] > limit:
        found.append(f"needs {row['smem_bytes']} bytes of shared memory, over {limit}")
    if row["wgmma_serialized"]:
        found.append("ptxas serialized its wgmmas (see the ptxas log)")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ptxattn.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=list(archs.ARCHS))
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.add_argument("--jobs", type=int, default=2,
                        help="parallel NVRTC compiles (0: compile in this process)")
    args = parser.parse_args(argv)

    specs = all_variants(args.arch)
    if args.jobs > 0:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(_row, specs, [args.arch] * len(specs)))
    else:
        rows = [_row(spec, args.arch) for spec in specs]

    failures = [(row, problem) for row in rows for problem in _problems(row)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'variant':44} {'arch':8} {'regs':>5} {'spill B':>8} {'smem B':>8}")
        for row in rows:
            if "error" in row:
                print(f"{row['name']:44} {row['arch']:8} compile error")
                continue
            print(f"{row['name']:44} {row['arch']:8} {row['registers']:5d} "
                  f"{row['spill_bytes']:8d} {row['smem_bytes']:8d}")
    for row, problem in failures:
        print(f"FAIL {row['name']} ({row['arch']}): {problem}", file=sys.stderr)
        if "error" in row:
            print(row["error"], file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
