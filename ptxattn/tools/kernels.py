"""Compile every kernel variant ptxattn ships for one architecture and report its budget.

    python -m ptxattn kernels --arch sm_90a [--json]
    python -m ptxattn kernels --arch sm_90a --warm

Needs no GPU. Exits non-zero if any variant fails to compile, spills registers, needs more
shared memory than one block may have on that architecture, or has its wgmmas serialized by
ptxas (which it does, silently but for a log line, when it cannot prove a kernel's
asynchronous wgmmas safe: the kernel then runs far slower).

--warm only fills the compile cache (runtime.cache_dir()) with every variant, for a container
image or a CI cache, so that no process there compiles: it reports how many variants NVRTC
compiled and how many were cached already, shows a progress bar on a terminal, and exits
non-zero if a variant does not compile or the cache directory cannot be written.

While it compiles it shows a progress bar when its output is a terminal, and otherwise a line
"compiled 40/161" on stderr every PROGRESS_EVERY_S seconds and at the end (so that a CI log shows
it is alive). A reader that stops early (``| head``) ends it quietly, with exit status 141 (as a
process killed by SIGPIPE).
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Callable

from .. import archs, dispatch, runtime
from ..launchers import backward_prepost, split_kv
from ..quant import blockscaled as blockscaled_quantizers, fp8 as fp8_quantizers

# Every module that ships kernels, each with variants() -> list[KernelSpec]: the dispatch
# table's launchers, the kernels they share, and the quantizers.
KERNEL_MODULES = (*dispatch.LAUNCHERS, backward_prepost, split_kv, fp8_quantizers,
                  blockscaled_quantizers)
# ptxas's info line (C7510-C7520) when it makes every wgmma of a kernel wait for the previous.
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"
# Seconds between the count lines shown instead of a progress bar off a terminal.
PROGRESS_EVERY_S = 10.0
# The exit status after the reader of the output went away: a shell's for a process that
# SIGPIPE killed (128 + 13).
BROKEN_PIPE_STATUS = 141


def quiet_on_broken_pipe(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` (argv -> exit status) that, when the reader of stdout goes away (``| head``),
    stops without a traceback and returns BROKEN_PIPE_STATUS. stdout is then pointed at
    os.devnull, so that the interpreter's own flush at exit does not fail again."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            try:
                return main(argv)
            finally:  # output still buffered (argparse's --help too) fails here, not at exit
                sys.stdout.flush()
        except BrokenPipeError:
            _stdout_to_devnull()
            return BROKEN_PIPE_STATUS

    return wrapper


class _Discard(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # no descriptor (a test's stand-in)
        sys.stdout = _Discard()
    finally:
        os.close(devnull)


def all_variants(arch: str) -> list[runtime.KernelSpec]:
    specs = []
    for module in KERNEL_MODULES:
        specs += [s for s in module.variants() if arch in s.archs]
    return specs


def budget_row(spec: runtime.KernelSpec, arch: str) -> dict:
    """One variant compiled for ``arch``: its registers, spills, shared memory and whether
    ptxas serialized its wgmmas, or the error that stopped it (budget_problems reads it)."""
    try:
        compiled = runtime.compile(spec, arch)
        return {"name": spec.name, "arch": arch, "registers": compiled.reported().registers,
                "spill_bytes": compiled.spill_bytes, "smem_bytes": compiled.smem_bytes,
                "wgmma_serialized": WGMMA_SERIALIZED in compiled.log}
    except runtime.CompileError as err:
        return {"name": spec.name, "arch": arch, "error": err.log}
    except runtime.PtxattnError as err:  # compiled, but this NVRTC gave no ptxas report
        return {"name": spec.name, "arch": arch, "error": str(err)}


def _warm_one(spec: runtime.KernelSpec, arch: str) -> dict:
    """Puts one variant in the disk cache: its name, the NVRTC compiles that took (0 when it was
    cached already) and, if it does not compile, NVRTC's log."""
    before = runtime.compile_counts["nvrtc"]
    try:
        runtime.compile(spec, arch)
    except runtime.CompileError as err:
        return {"name": spec.name, "compiled": 0, "error": err.log}
    return {"name": spec.name, "compiled": runtime.compile_counts["nvrtc"] - before}


def for_each_spec(work: Callable[[runtime.KernelSpec, str], dict],
                  specs: list[runtime.KernelSpec], arch: str, jobs: int,
                  on_done: Callable[[int], None] | None = None, mp_context=None) -> list[dict]:
    """work(spec, arch) for every spec, in `jobs` processes (0: in this one) started by
    `mp_context` (default: the platform's), in the order of specs; on_done(number finished)
    after each."""
    if jobs == 0:
        rows = []
        for spec in specs:
            rows.append(work(spec, arch))
            if on_done:
                on_done(len(rows))
        return rows
    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp_context) as pool:
        futures = [pool.submit(work, spec, arch) for spec in specs]
        for done, _ in enumerate(as_completed(futures), 1):
            if on_done:
                on_done(done)
        return [future.result() for future in futures]


def draw_progress(done: int, total: int, width: int = 40) -> None:
    filled = width * done // total
    end = "\n" if done == total else ""
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, flush=True)


def progress(total: int, verb: str = "compiled") -> Callable[[int], None] | None:
    """for_each_spec's on_done for ``total`` items: a progress bar when stdout is a terminal,
    else a line "<verb> done/total" on stderr at most every PROGRESS_EVERY_S seconds and when
    the last is done; None for no items."""
    if not total:
        return None
    if sys.stdout.isatty():
        return lambda done: draw_progress(done, total)
    last = time.monotonic()

    def count(done: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done == total or now - last >= PROGRESS_EVERY_S:
            last = now
            print(f"{verb} {done}/{total}", file=sys.stderr, flush=True)

    return count


def warm(arch: str, jobs: int) -> int:
    """Fills the compile cache with every variant for ``arch``; the exit status."""
    root = runtime.cache_dir()
    try:  # in-memory kernels would be lost with this process: warming needs the disk
        root.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=root).close()
    except OSError as err:
        print(f"cannot write the compile cache {root}: {err}", file=sys.stderr)
        return 1
    specs = all_variants(arch)
    start = time.perf_counter()
    rows = for_each_spec(_warm_one, specs, arch, jobs, progress(len(specs)))
    failed = [row for row in rows if "error" in row]
    compiled = sum(row["compiled"] for row in rows)
    print(f"{arch}, {root}: {compiled} of {len(specs)} variants compiled by NVRTC, "
          f"{len(specs) - compiled - len(failed)} cached already, {len(failed)} failed "
          f"({time.perf_counter() - start:.1f} s)")
    for row in failed:
        print(f"FAIL {row['name']} ({arch}): does not compile\n{row['error']}", file=sys.stderr)
    return 1 if failed else 0


def budget_problems(row: dict) -> list[str]:
    """What keeps a budget_row from passing the CLI's checks (none: it passes)."""
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


def print_table(rows: list[dict]) -> None:
    """The budget rows as a table, each column as wide as its longest entry."""
    name_width = max([len("variant")] + [len(row["name"]) for row in rows])
    arch_width = max([len("arch")] + [len(row["arch"]) for row in rows])
    print(f"{'variant':{name_width}} {'arch':{arch_width}} {'regs':>5} {'spill B':>8} "
          f"{'smem B':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['name']:{name_width}} {row['arch']:{arch_width}} compile error")
            continue
        print(f"{row['name']:{name_width}} {row['arch']:{arch_width}} {row['registers']:5d} "
              f"{row['spill_bytes']:8d} {row['smem_bytes']:8d}")


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ptxattn kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=list(archs.ARCHS))
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    output.add_argument("--warm", action="store_true",
                        help="only fill the compile cache, with a progress bar on a terminal")
    parser.add_argument("--jobs", type=int,
                        help="parallel NVRTC compiles (0: compile in this process; default 2, "
                             "with --warm one per CPU)")
    args = parser.parse_args(argv)

    if args.warm:
        return warm(args.arch, (os.cpu_count() or 1) if args.jobs is None else args.jobs)
    specs = all_variants(args.arch)
    rows = for_each_spec(budget_row, specs, args.arch, 2 if args.jobs is None else args.jobs,
                         progress(len(specs)))

    failures = [(row, problem) for row in rows for problem in budget_problems(row)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print_table(rows)
    for row, problem in failures:
        print(f"FAIL {row['name']} ({row['arch']}): {problem}", file=sys.stderr)
        if "error" in row:
            print(row["error"], file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
