"""Tables of tuned tile schedules: their format, where they live, and the order they are read in.

``python -m ptxattn tune`` measures tile schedules on a GPU and writes the winners into a table;
the Hopper launcher (``hopper_forward.variant``) takes its schedule from the first table that has
the call's key, in this order:

1. the file ``$PTXATTN_TUNE_TABLE`` names (the value ``builtin``: no table at all, the built-in
   schedules for every call, as an A/B of kernel code wants);
2. the user's own: ``<compile cache>/tuned/<arch>.json`` (``runtime.cache_dir()``), which
   ``python -m ptxattn tune`` writes when given no ``--output``;
3. the one shipped with the package, ``ptxattn/tuned/<arch>.json``;

and otherwise from the schedules built into the launcher (``hopper_forward.SCHEDULES``). Each
table is read once per process, on the first call that needs it. A ``$PTXATTN_TUNE_TABLE`` that names no
file, or a table that cannot be read, is an error naming it; except the user's own, which is
skipped with a warning, so that a table a newer ptxattn no longer reads blocks neither calls nor
``python -m ptxattn tune``, which writes a new one.

A key is (arch, family, dtype, head_dim, causal, bucket). Families: "hopper" (16-bit inputs,
dtype "bfloat16" or "float16") and "hopper-fp8" (e4m3 inputs, dtype "e4m3" whatever the output
type: the output conversion is the only code the two differ in). The bucket is that of the
call's seqlen_k (``bucket``): the best tiles for 32 sequences of 512 keys are not those for one
of 16384.

A table is JSON::

    {"version": 1, "arch": "sm_90a", "device": "NVIDIA H100 80GB HBM3", "measured": true,
     "command": "python -m ptxattn tune --quick ...",
     "entries": [{"family": "hopper", "dtype": "bfloat16", "head_dim": 128, "causal": false,
                  "bucket": "medium", "schedule": {"block_n": 128, "stages": 2, ...},
                  "tflops": 690.3, ...}, ...]}

``schedule`` holds the fields of ``hopper_forward.Schedule``; the tuner adds what it measured
beside it (``tools/tune.py`` documents those fields), which lookups ignore.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path

from .. import runtime

VERSION = 1
ENV_VAR = "PTXATTN_TUNE_TABLE"
BUILTIN_ONLY = "builtin"  # the value of ENV_VAR that turns every table off
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "tuned"

# seqlen_k buckets: (name, largest seqlen_k in it); the last one takes every longer sequence.
BUCKETS = (("short", 1024), ("medium", 4096), ("long", None))
BUCKET_NAMES = tuple(name for name, _ in BUCKETS)
# The bucket of a lookup that gives no seqlen_k: where the built-in schedules were tuned
# (seqlen 2048 and 8192, batch * seqlen = 16384).
DEFAULT_BUCKET = "medium"

_KEY_FIELDS = ("family", "dtype", "head_dim", "causal", "bucket")


def bucket(seqlen_k: int | None) -> str:
    """The bucket of a call with ``seqlen_k`` keys (DEFAULT_BUCKET for None)."""
    if seqlen_k is None:
        return DEFAULT_BUCKET
    for name, longest in BUCKETS:
        if longest is None or seqlen_k <= longest:
            return name
    raise AssertionError("the last bucket is unbounded")


def user_path(arch: str) -> Path:
    """Where ``python -m ptxattn tune`` writes a user's own table by default: beside the kernels
    of the compile cache, so it goes where they go (a container image, a shared directory)."""
    return runtime.cache_dir() / "tuned" / f"{arch}.json"


def shipped_path(arch: str) -> Path:
    return SHIPPED_DIR / f"{arch}.json"


def table_paths(arch: str) -> list[Path]:
    """The tables a lookup for ``arch`` reads, first match wins."""
    paths = [user_path(arch), shipped_path(arch)]
    named = os.environ.get(ENV_VAR)
    if named:
        paths.insert(0, Path(os.path.expanduser(os.path.expandvars(named))))
    return paths


def read(path: Path) -> dict:
    """The table in ``path``, checked for the fields lookups use; ValueError naming the file and
    what is wrong otherwise."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"tile schedule table {path}: cannot be read ({err})") from err
    problem = _format_problem(table)
    if problem:
        raise ValueError(f"tile schedule table {path}: {problem}; write a new one with "
                         f"python -m ptxattn tune")
    return table


def _format_problem(table) -> str | None:
    if not isinstance(table, dict):
        return "not a JSON object"
    if table.get("version") != VERSION:
        return f"version {table.get('version')!r}, this ptxattn reads version {VERSION}"
    if not isinstance(table.get("arch"), str) or not isinstance(table.get("entries"), list):
        return "no 'arch' string or no 'entries' list"
    for entry in table["entries"]:
        if (not isinstance(entry, dict) or any(f not in entry for f in _KEY_FIELDS)
                or not isinstance(entry.get("schedule"), dict)):
            return f"an entry lacks one of {_KEY_FIELDS + ('schedule',)}: {entry!r}"
        if entry["bucket"] not in BUCKET_NAMES:
            return f"unknown bucket {entry['bucket']!r} (buckets: {BUCKET_NAMES})"
    return None


def entry_key(entry: dict) -> tuple:
    """(family, dtype, head_dim, causal, bucket) of a table entry."""
    return tuple(entry[f] for f in _KEY_FIELDS)


def schedules_in(path: Path, arch: str) -> dict[tuple, dict]:
    """Key -> schedule fields of the table in ``path`` for ``arch`` (empty if there is no such
    file, or it is another arch's)."""
    if not path.is_file():
        return {}
    table = read(path)
    if table["arch"] != arch:
        return {}
    return {entry_key(e): e["schedule"] for e in table["entries"]}


@functools.cache
def _tables(arch: str) -> tuple[dict[tuple, dict], ...]:
    named = os.environ.get(ENV_VAR)
    if named == BUILTIN_ONLY:
        return ()
    if named and not table_paths(arch)[0].is_file():
        raise ValueError(f"${ENV_VAR} = {named!r} names no file")
    tables = []
    for path in table_paths(arch):
        try:
            tables.append(schedules_in(path, arch))
        except ValueError as err:
            if path != user_path(arch):
                raise
            warnings.warn(f"{err}; skipped", RuntimeWarning, stacklevel=2)
    return tuple(tables)


def lookup(arch: str, family: str, dtype: str, head_dim: int, causal: bool,
           seqlen_k: int | None = None) -> dict | None:
    """The schedule fields for a call, from the first table (module docstring) that has its key,
    or None when none does."""
    key = (family, dtype, head_dim, causal, bucket(seqlen_k))
    for table in _tables(arch):
        if key in table:
            return table[key]
    return None


def shipped(arch: str, family: str, dtype: str, head_dim: int, causal: bool) -> dict[str, dict]:
    """Bucket -> schedule fields in the shipped table alone: what a call can reach on a machine
    with no table of its own, which the kernels CLI compiles and checks."""
    table = schedules_in(shipped_path(arch), arch)
    return {name: table[(family, dtype, head_dim, causal, name)] for name in BUCKET_NAMES
            if (family, dtype, head_dim, causal, name) in table}


def write(path: Path, table: dict) -> None:
    """Writes ``table`` to ``path`` (creating its directory) through a temporary file and a
    rename, so that a process reading it meanwhile sees the old table or the new one."""
    problem = _format_problem(table)
    if problem:
        raise ValueError(f"refusing to write a malformed table: {problem}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    os.replace(tmp, path)
