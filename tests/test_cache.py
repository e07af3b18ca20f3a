"""The on-disk compile cache: what its key hashes, sharing between installs and processes,
damaged entries, directories that cannot be written, and `python -m ptxattn kernels --warm`.
NVRTC only, no GPU."""

import collections
import errno
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ptxattn import runtime
from ptxattn.tools import kernels
from test_runtime import PROBE

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory, and a runtime that has compiled nothing in this process."""
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(runtime, "_compiled", {})
    monkeypatch.setattr(runtime, "compile_counts", collections.Counter())
    monkeypatch.setattr(runtime, "_unwritable_dirs", set())
    return tmp_path / "cache"


def test_cache_is_reused_by_a_new_process_state(cache, monkeypatch):
    first = runtime.compile(PROBE, "sm_90a")
    monkeypatch.setattr(runtime, "_compiled", {})
    monkeypatch.setattr(runtime, "_nvrtc_compile",
                        lambda spec, arch: pytest.fail("cache entry was not reused"))
    assert runtime.compile(PROBE, "sm_90a").cubin == first.cubin


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_corrupt_cache_entry_is_rebuilt_not_loaded(cache, monkeypatch, damage):
    good = runtime.compile(PROBE, "sm_90a")
    (path,) = cache.glob("*.cubin")
    blob = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        path.write_bytes(blob[:-10] + bytes([blob[-10] ^ 0xFF]) + blob[-9:])
    else:
        path.write_bytes(b"not a cache entry")
    monkeypatch.setattr(runtime, "_compiled", {})
    rebuilt = []
    real = runtime._nvrtc_compile
    monkeypatch.setattr(runtime, "_nvrtc_compile",
                        lambda spec, arch: rebuilt.append(1) or real(spec, arch))
    assert runtime.compile(PROBE, "sm_90a").cubin == good.cubin
    assert rebuilt == [1]
    assert runtime._read_cache_entry(path) is not None


def test_cache_key_tracks_everything_that_changes_the_binary(cache, monkeypatch):
    base = runtime.cache_key(PROBE, "sm_90a")
    assert runtime.cache_key(PROBE, "sm_120a") != base
    other = runtime.KernelSpec(PROBE.name, PROBE.source, PROBE.entry, defines={"X": 1},
                               archs=PROBE.archs)
    assert runtime.cache_key(other, "sm_90a") != base
    monkeypatch.setattr(runtime, "nvrtc_version", lambda: (99, 0))
    assert runtime.cache_key(PROBE, "sm_90a") != base


def test_cache_key_tracks_included_headers(tmp_path, monkeypatch):
    (tmp_path / "k.cu").write_text('#include "a.cuh"\n')
    (tmp_path / "a.cuh").write_text('#include "b.cuh"\n')
    (tmp_path / "b.cuh").write_text("// one\n")
    monkeypatch.setattr(runtime, "SOURCE_DIR", tmp_path)
    spec = runtime.KernelSpec("k", "k.cu", "k")
    before = runtime.cache_key(spec, "sm_80")
    (tmp_path / "b.cuh").write_text("// two\n")
    assert runtime.cache_key(spec, "sm_80") != before


def test_cache_key_and_options_hold_no_install_path(tmp_path, monkeypatch):
    keys = set()
    for copy in ("a", "b/deeper"):
        monkeypatch.setattr(runtime, "SOURCE_DIR", shutil.copytree(runtime.SOURCE_DIR,
                                                                   tmp_path / copy))
        assert not any(str(tmp_path) in option for option in PROBE.options("sm_90a"))
        keys.add(runtime.cache_key(PROBE, "sm_90a"))
    assert len(keys) == 1


def _install(root: Path, layout: str) -> Path:
    """A copy of ptxattn under ``root``: its sources beside the package as in a checkout, or
    inside it as a wheel installs them."""
    shutil.copytree(REPO / "ptxattn", root / "ptxattn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    sources = root / "ptx_src" if layout == "checkout" else root / "ptxattn" / "ptx_src"
    shutil.copytree(REPO / "ptx_src", sources)
    return root


# Run by a fresh interpreter in one install: compiles PROBE, says what it used and did.
_COMPILE_AND_REPORT = f"""
import hashlib, json
from ptxattn import runtime
from ptxattn.tools import kernels
from ptxattn.runtime import KernelSpec
compiled = runtime.compile({PROBE!r}, "sm_90a")
print(json.dumps({{"package": runtime.__file__, "sources": str(runtime.SOURCE_DIR),
                  "counts": runtime.compile_counts,
                  "cubin": hashlib.sha256(compiled.cubin).hexdigest()}}))
"""


def test_installs_at_different_paths_share_entries_with_zero_recompiles(tmp_path):
    reports = []
    for name, layout in (("venv-a/site", "checkout"), ("elsewhere/venv-b/site", "wheel")):
        root = _install(tmp_path / name, layout)
        done = subprocess.run(
            [sys.executable, "-c", _COMPILE_AND_REPORT], cwd=tmp_path, capture_output=True,
            text=True, env={**os.environ, "PYTHONPATH": str(root),
                            "PTXATTN_CACHE_DIR": str(tmp_path / "shared-cache")})
        assert done.returncode == 0, done.stderr
        reports.append(json.loads(done.stdout))
        assert reports[-1]["package"].startswith(str(root))
        assert reports[-1]["sources"].startswith(str(root))
    first, second = reports
    assert first["counts"] == {"nvrtc": 1}
    assert second["counts"] == {"disk": 1}, "the second install recompiled"
    assert second["cubin"] == first["cubin"]
    assert len(list((tmp_path / "shared-cache").glob("*.cubin"))) == 1


def _compile_when_all_are_ready(start, cache_dir: str, results) -> None:
    os.environ["PTXATTN_CACHE_DIR"] = cache_dir
    runtime.nvrtc_version()  # NVRTC loaded before the start, so that the race is on the compile
    start.wait(timeout=120)
    runtime.compile(PROBE, "sm_90a")
    results.put(dict(runtime.compile_counts))


def test_processes_racing_on_one_variant_compile_it_once(tmp_path):
    racers = 8
    spawn = multiprocessing.get_context("spawn")
    start, results = spawn.Barrier(racers), spawn.Queue()
    processes = [spawn.Process(target=_compile_when_all_are_ready,
                               args=(start, str(tmp_path), results)) for _ in range(racers)]
    for process in processes:
        process.start()
    counts = [results.get(timeout=300) for _ in processes]
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert sum(c.get("nvrtc", 0) for c in counts) == 1, counts
    assert sum(c.get("disk", 0) for c in counts) == racers - 1, counts
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    assert not list(tmp_path.glob("*.lock")), "a lock file was left behind"
    assert len((tmp_path / runtime.INDEX_FILE).read_text().splitlines()) == 1


def test_entries_are_named_by_their_key_and_indexed_beside(cache):
    """File names carry no spaces, '::' or '<>' of a template entry: the key alone; the index
    names the kernel of each, and no lock file stays."""
    spec = runtime.KernelSpec("templated_probe", PROBE.source, PROBE.entry, archs=PROBE.archs,
                              smem_bytes=PROBE.smem_bytes, defines={"UNUSED": 1})
    runtime.compile(spec, "sm_90a")
    (path,) = cache.glob("*.cubin")
    key = runtime.cache_key(spec, "sm_90a")
    assert path.name == f"{key}.cubin" and key.isalnum()
    assert (cache / runtime.INDEX_FILE).read_text() == (
        f"{key}\tsm_90a\ttemplated_probe\t{spec.entry}\n")
    assert sorted(p.name for p in cache.iterdir()) == sorted([path.name, runtime.INDEX_FILE])


def _compile_two_recording_warnings() -> tuple[runtime.CompiledKernel, list]:
    """PROBE for sm_90a twice and for sm_120a once; the first kernel and the warnings given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = runtime.compile(PROBE, "sm_90a")
        runtime.compile(PROBE, "sm_120a")
        assert runtime.compile(PROBE, "sm_90a") is first  # from memory
    assert first.cubin[:4] == b"\x7fELF"
    return first, caught


def test_cache_dir_that_cannot_be_created_falls_back_to_memory_with_one_warning(
        cache, tmp_path, monkeypatch):
    # mkdir under a regular file fails for root too, where permission bits would not.
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    _, caught = _compile_two_recording_warnings()
    assert [w.category for w in caught] == [runtime.CacheWarning]
    assert str(tmp_path / "a-file" / "cache") in str(caught[0].message)
    assert runtime.compile_counts == {"nvrtc": 2}


def test_full_cache_dir_falls_back_to_memory_with_one_warning(cache, monkeypatch):
    writes = []

    def disk_full(path, cubin, log, symbol):
        writes.append(path)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(runtime, "_write_cache_entry", disk_full)
    _, caught = _compile_two_recording_warnings()
    assert [w.category for w in caught] == [runtime.CacheWarning]
    assert "No space left" in str(caught[0].message)
    assert len(writes) == 1, "a directory that failed a write was written to again"
    assert runtime.compile_counts == {"nvrtc": 2}
    assert not list(cache.glob("*.cubin"))


@pytest.mark.parametrize("how", ["chmod", "lock refused"])
def test_read_only_cache_dir_serves_its_entries_and_keeps_new_kernels_in_memory(
        cache, monkeypatch, how):
    if how == "chmod" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory anyway; 'lock refused' simulates it")
    runtime.compile(PROBE, "sm_90a")  # a pre-warmed entry, as in a read-only image
    monkeypatch.setattr(runtime, "_compiled", {})
    monkeypatch.setattr(runtime, "compile_counts", collections.Counter())
    if how == "chmod":
        cache.chmod(0o555)
    else:
        def refused(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        monkeypatch.setattr(runtime, "_lock_entry", refused)
    try:
        _, caught = _compile_two_recording_warnings()
    finally:
        cache.chmod(0o755)
    assert [w.category for w in caught] == [runtime.CacheWarning]
    assert runtime.compile_counts == {"disk": 1, "nvrtc": 1}
    assert len(list(cache.glob("*.cubin"))) == 1


def test_cache_dir_expands_home_and_variables(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PTXATTN_CACHE_DIR", "$SCRATCH/kernels")
    assert runtime.cache_dir() == tmp_path / "scratch" / "kernels"
    monkeypatch.delenv("PTXATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert runtime.cache_dir() == tmp_path / "home" / "xdg" / "ptxattn"
    monkeypatch.setenv("PTXATTN_CACHE_DIR", "~/kernels")
    assert runtime.cache_dir() == tmp_path / "home" / "kernels"
    runtime.compile(PROBE, "sm_90a")
    assert len(list((tmp_path / "home" / "kernels").glob("*.cubin"))) == 1
    assert not (tmp_path / "~").exists()


def test_a_header_in_the_current_directory_does_not_shadow_ours(cache, tmp_path, monkeypatch):
    # NVRTC would look here first by default, and the cache key would not see the stray file.
    (tmp_path / "tma.cuh").write_text("#error a stray tma.cuh was compiled in\n")
    monkeypatch.chdir(tmp_path)
    assert runtime.compile(PROBE, "sm_90a").cubin[:4] == b"\x7fELF"


def test_warm_fills_the_cache_once(cache, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "all_variants", lambda arch: [PROBE])
    assert kernels.main(["--arch", "sm_90a", "--warm", "--jobs", "0"]) == 0
    assert "1 of 1 variants compiled by NVRTC, 0 cached already, 0 failed" in capsys.readouterr().out
    assert len(list(cache.glob("*.cubin"))) == 1
    monkeypatch.setattr(runtime, "_compiled", {})
    assert kernels.main(["--arch", "sm_90a", "--warm", "--jobs", "2"]) == 0
    assert "0 of 1 variants compiled by NVRTC, 1 cached already" in capsys.readouterr().out


def test_warm_draws_a_progress_bar_on_a_terminal_only(cache, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "all_variants", lambda arch: [PROBE, PROBE])
    assert kernels.main(["--arch", "sm_90a", "--warm", "--jobs", "0"]) == 0
    assert "[" not in capsys.readouterr().out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert kernels.main(["--arch", "sm_90a", "--warm", "--jobs", "0"]) == 0
    out = capsys.readouterr().out
    assert "\r[" + "#" * 20 + "." * 20 + "] 1/2" in out
    assert "\r[" + "#" * 40 + "] 2/2\n" in out


def test_warm_fails_on_a_cache_dir_it_cannot_write(cache, tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PTXATTN_CACHE_DIR", str(tmp_path / "a-file" / "cache"))
    assert kernels.main(["--arch", "sm_90a", "--warm"]) == 1
    assert "cannot write the compile cache" in capsys.readouterr().err
