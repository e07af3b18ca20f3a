"""Print a digest of every shipped kernel variant's CUBIN, per architecture.

    python scripts/cubin_digest.py > before.txt
    # ... restructure ...
    python scripts/cubin_digest.py > after.txt
    diff before.txt after.txt   # empty: no kernel changed

Compiles every variant that `python -m ptxattn.kernels` budgets (default: for sm_80, sm_90a and
sm_120a) with NVRTC, in a fresh compile cache so that nothing is read back from an earlier run,
and prints one line per variant: arch, variant name, the SHA-256 of its CUBIN, and a last line
per arch digesting all of them. Needs no GPU. A change meant to leave every kernel alone (a
header moved, a comment corrected, host code reorganised) is proven by an empty diff.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_ARCHS = ("sm_80", "sm_90a", "sm_120a")


def _digest_one(spec, arch: str) -> dict:
    from ptxattn import runtime
    try:
        compiled = runtime.compile(spec, arch)
    except runtime.CompileError as err:
        return {"name": spec.name, "error": err.log}
    return {"name": spec.name, "sha256": hashlib.sha256(compiled.cubin).hexdigest()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", action="append", help="an architecture (repeatable; default: "
                        + ", ".join(DEFAULT_ARCHS) + ")")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel NVRTC compiles (default: one per CPU)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ptxattn-digest-") as cache:
        os.environ["PTXATTN_CACHE_DIR"] = cache  # before the workers start: they inherit it
        from ptxattn import kernels
        failed = 0
        for arch in args.arch or DEFAULT_ARCHS:
            specs = sorted(kernels.all_variants(arch), key=lambda spec: spec.name)
            rows = kernels.for_each_spec(_digest_one, specs, arch, args.jobs)
            total = hashlib.sha256()
            for row in rows:
                if "error" in row:
                    failed += 1
                    print(f"{arch} {row['name']} COMPILE-ERROR", flush=True)
                    print(row["error"], file=sys.stderr)
                    continue
                total.update(f"{row['name']} {row['sha256']}\n".encode())
                print(f"{arch} {row['name']} {row['sha256']}", flush=True)
            print(f"{arch} ALL({len(rows)}) {total.hexdigest()}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
