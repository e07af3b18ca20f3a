"""Print a digest of every shipped kernel variant's CUBIN, per architecture.

    python scripts/cubin_digest.py > before.txt
    # ... restructure ...
    python scripts/cubin_digest.py > after.txt
    diff before.txt after.txt   # empty: no kernel changed
    python scripts/cubin_digest.py --code-only   # the same, blind to symbol names

Compiles every variant that `python -m ptxattn kernels` budgets (default: for sm_80, sm_90a and
sm_120a) with NVRTC, in a fresh compile cache so that nothing is read back from an earlier run,
and prints one line per variant: arch, variant name, the SHA-256 of its CUBIN, and a last line
per arch digesting all of them. Needs no GPU. A change meant to leave every kernel alone (a
header moved, a comment corrected, host code reorganised) is proven by an empty diff.

The digest is of the CUBIN's ELF sections with the names of internal-linkage symbols
normalised: NVRTC names those after the source file plus a random suffix that differs from one
compile to the next (``_INTERNAL_00000000_18_fwd_blockscaled_cu_0de14adf_36787``), so the
bytes of the file differ between two compiles of the same source; the code, data and every
other symbol are digested as they are.

``--code-only`` digests the instructions alone, the contents of the ``.text`` sections, and the
sizes of the ``.nv.shared`` ones, without names: a change that renames the kernels' symbols and
adds constants beside them (a template argument added to every variant's configuration, whose
value is a new static member) then leaves every digest as it was, while a changed instruction,
register allocation or shared-memory size shows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import struct
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_ARCHS = ("sm_80", "sm_90a", "sm_120a")


# An internal-linkage name with its length prefix (Itanium mangling), as NVRTC makes it.
_INTERNAL_NAME = re.compile(rb"\d*_INTERNAL_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}_\d+")
_SHT_SYMTAB, _SHT_STRTAB, _SHT_NOBITS = 2, 3, 8


def _string(table: bytes, offset: int) -> bytes:
    return _INTERNAL_NAME.sub(b"_INTERNAL_", table[offset:table.index(b"\0", offset)])


def elf_digest(cubin: bytes) -> str:
    """SHA-256 of a 64-bit little-endian ELF: its identification, type, machine and flags, and
    every section's header fields and contents, string tables through the names that use them
    (internal-linkage names normalised). File offsets are left out: they follow the sizes of
    the string tables."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]

    def contents(index: int) -> bytes:
        offset, size = sections[index][4], sections[index][5]
        return cubin[offset:offset + size]

    section_names = contents(shstrndx)
    digest = hashlib.sha256(cubin[:0x18] + cubin[0x30:0x34])  # ident, type, machine, flags
    for index, (name, kind, flags, _, _, size, link, info, align, entsize) in enumerate(sections):
        digest.update(_string(section_names, name) + b"\0")
        # a string table's size follows the names in it, which the symbols digest
        digest.update(repr((kind, flags, 0 if kind == _SHT_STRTAB else size, link, info, align,
                            entsize)).encode())
        if kind == _SHT_SYMTAB:
            strings, table = contents(link), contents(index)
            for offset in range(0, len(table), 24):
                st_name, *fields = struct.unpack_from("<IBBHQQ", table, offset)
                digest.update(_string(strings, st_name) + repr(fields).encode())
        elif kind not in (_SHT_STRTAB, _SHT_NOBITS):
            digest.update(contents(index))
    return digest.hexdigest()


def code_digest(cubin: bytes) -> str:
    """SHA-256 of a 64-bit little-endian ELF's ``.text`` sections' contents and its
    ``.nv.shared`` sections' sizes, in section order, without their names."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]
    names = cubin[sections[shstrndx][4]:sections[shstrndx][4] + sections[shstrndx][5]]
    digest = hashlib.sha256()
    for name, _, _, _, offset, size, *_ in sections:
        name = names[name:names.index(b"\0", name)]
        if name.startswith(b".text."):
            digest.update(cubin[offset:offset + size])
        elif name.startswith(b".nv.shared."):
            digest.update(repr(size).encode())
    return digest.hexdigest()


def _digest_one(spec, arch: str, code_only: bool = False) -> dict:
    from ptxattn import runtime
    try:
        compiled = runtime.compile(spec, arch)
    except runtime.CompileError as err:
        return {"name": spec.name, "error": err.log}
    return {"name": spec.name,
            "sha256": (code_digest if code_only else elf_digest)(compiled.cubin)}


def _code_digest_one(spec, arch: str) -> dict:
    return _digest_one(spec, arch, code_only=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", action="append", help="an architecture (repeatable; default: "
                        + ", ".join(DEFAULT_ARCHS) + ")")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel NVRTC compiles (default: one per CPU)")
    parser.add_argument("--code-only", action="store_true",
                        help="digest the sections' contents alone, blind to symbol names")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ptxattn-digest-") as cache:
        os.environ["PTXATTN_CACHE_DIR"] = cache  # before the workers start: they inherit it
        from ptxattn.tools import kernels
        failed = 0
        for arch in args.arch or DEFAULT_ARCHS:
            specs = sorted(kernels.all_variants(arch), key=lambda spec: spec.name)
            rows = kernels.for_each_spec(_code_digest_one if args.code_only else _digest_one,
                                         specs, arch, args.jobs)
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
