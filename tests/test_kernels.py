"""Every kernel variant ptxattn ships compiles for every target, within its budgets, on a
machine with no GPU (NVRTC only)."""

import errno
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from probe_kernels import probe_spec
from ptxattn import archs, runtime
from ptxattn.tools import kernels


@pytest.mark.parametrize("arch", list(archs.ARCHS))
def test_every_variant_compiles_without_spills_within_smem(arch, capsys):
    if runtime.nvrtc_version() < (13, 5):
        pytest.skip("NVRTC 13.0 leaves ptxas's report out of the log for later compiles in a "
                    "process, so budgets are checked where CI runs, with NVRTC 13.5")
    status = kernels.main(["--arch", arch, "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert status == 0, [row for row in rows if "error" in row or row["spill_bytes"]]
    assert rows, f"no variants for {arch}"
    for row in rows:
        assert set(row) == {"name", "arch", "registers", "spill_bytes", "smem_bytes",
                            "wgmma_serialized"}
        assert row["spill_bytes"] == 0
        assert not row["wgmma_serialized"]
        assert row["smem_bytes"] <= archs.SMEM_LIMIT_BYTES[arch]
    names = [row["name"] for row in rows]
    families = archs.get(arch).families
    assert any(n.startswith("fwd_mma_sync") for n in names), "portable kernel missing"
    if "hopper" in families:
        assert any(n.startswith("fwd_sm90") for n in names), "Hopper kernel missing"
    if "blockscaled" in families:
        assert any(n.startswith("blockscaled") and "native" in n for n in names)
    if "blockscaled" in archs.get(arch).emulated_families:
        assert any(n.startswith("blockscaled") and "emulated" in n for n in names)


def _cli_on_one_variant(monkeypatch, spec, report, log="", arch="sm_90a") -> int:
    """kernels.main on `spec` alone, compiled to the given ptxas report and log."""
    monkeypatch.setattr(runtime, "compile", lambda spec, arch: runtime.CompiledKernel(
        spec, arch, b"", report, log))
    monkeypatch.setattr(kernels, "all_variants", lambda arch: [spec])
    return kernels.main(["--arch", arch, "--jobs", "0"])


def test_cli_fails_on_a_spilling_variant(monkeypatch, capsys):
    spec = probe_spec("spills", "tma_copy_probe.cu", "tma_copy_probe", archs=("sm_90a",))
    assert _cli_on_one_variant(monkeypatch, spec, runtime.PtxasReport(255, 64, 64, 0, 64)) == 1
    assert "FAIL spills (sm_90a): spills 128 bytes" in capsys.readouterr().err


def test_cli_fails_on_serialized_wgmmas(monkeypatch, capsys):
    log = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are "
           "serialized due to non wgmma instructions defining accumulator registers of a wgmma "
           "between start and end of the pipeline stage in the function 'k'")
    spec = probe_spec("serial", "tma_copy_probe.cu", "tma_copy_probe", archs=("sm_90a",))
    assert _cli_on_one_variant(monkeypatch, spec, runtime.PtxasReport(168, 0, 0, 0, 0), log) == 1
    assert "FAIL serial (sm_90a): ptxas serialized its wgmmas" in capsys.readouterr().err


def test_cli_fails_over_the_shared_memory_limit(monkeypatch, capsys):
    spec = probe_spec("huge", "tma_copy_probe.cu", "tma_copy_probe",
                      smem_bytes=100 * 1024, archs=("sm_120a",))
    assert _cli_on_one_variant(monkeypatch, spec, runtime.PtxasReport(64, 0, 0, 0, 0),
                               arch="sm_120a") == 1
    assert "over 101376" in capsys.readouterr().err


def _fake_compile(monkeypatch, report=runtime.PtxasReport(64, 0, 0, 0, 0)) -> None:
    monkeypatch.setattr(runtime, "compile", lambda spec, arch: runtime.CompiledKernel(
        spec, arch, b"", report, ""))


def _probes(count: int, prefix: str = "probe") -> list[runtime.KernelSpec]:
    return [probe_spec(f"{prefix}_{i}", "tma_copy_probe.cu", "tma_copy_probe", archs=("sm_90a",))
            for i in range(count)]


def test_table_columns_are_as_wide_as_their_longest_entry(monkeypatch, capsys):
    name = "fwd_sm90_bfloat16_d256_n80_s2_c2_smf_qr_p40_inturn_causal_serving_x"
    assert len(name) > 44
    spec = probe_spec(name, "tma_copy_probe.cu", "tma_copy_probe", archs=("sm_90a",))
    assert _cli_on_one_variant(monkeypatch, spec, runtime.PtxasReport(64, 0, 0, 0, 0)) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["variant", "arch", "regs", "spill", "B", "smem", "B"]
    assert row.startswith(f"{name} sm_90a ")
    assert header.index("arch") == row.index("sm_90a") == len(name) + 1
    assert len(header) == len(row)  # the right-aligned numbers end under their headings


def test_off_a_terminal_compiling_shows_a_count_on_stderr(monkeypatch, capsys):
    _fake_compile(monkeypatch)
    monkeypatch.setattr(kernels, "all_variants", lambda arch: _probes(3))
    monkeypatch.setattr(kernels, "PROGRESS_EVERY_S", 0.0)
    assert kernels.main(["--arch", "sm_90a", "--jobs", "0"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["compiled 1/3", "compiled 2/3", "compiled 3/3"]
    assert "[" not in out
    monkeypatch.setattr(kernels, "PROGRESS_EVERY_S", 1e9)  # "now and then": the last always
    assert kernels.main(["--arch", "sm_90a", "--jobs", "0", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == ["compiled 3/3"]
    assert len(json.loads(out)) == 3  # the count stays off the JSON


def test_on_a_terminal_compiling_draws_a_progress_bar(monkeypatch, capsys):
    _fake_compile(monkeypatch)
    monkeypatch.setattr(kernels, "all_variants", lambda arch: _probes(2))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert kernels.main(["--arch", "sm_90a", "--jobs", "0"]) == 0
    out, err = capsys.readouterr()
    assert "\r[" + "#" * 20 + "." * 20 + "] 1/2" in out
    assert "\r[" + "#" * 40 + "] 2/2\n" in out
    assert "compiled" not in err


class ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone away: every write fails as a closed pipe's does."""

    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


class BufferedClosedPipe(io.TextIOBase):
    """A closed pipe behind a buffer: the writes are kept, the flush (at the latest the one at
    exit) fails."""

    def write(self, text):
        return len(text)

    def flush(self):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    def close(self):  # no flush when collected
        pass


@pytest.mark.parametrize("pipe", [ClosedPipe, BufferedClosedPipe])
def test_a_reader_that_goes_away_ends_the_table_quietly(pipe, monkeypatch, capsys):
    _fake_compile(monkeypatch)
    monkeypatch.setattr(kernels, "all_variants", lambda arch: _probes(3))
    monkeypatch.setattr(sys, "stdout", pipe())
    assert kernels.main(["--arch", "sm_90a", "--jobs", "0"]) == kernels.BROKEN_PIPE_STATUS
    assert not isinstance(sys.stdout, pipe)  # later output (the exit's flush) goes nowhere


# A kernels run over 5,000 stand-in variants, whose table (some 250 kB) overfills a pipe.
PIPED_RUN = """
import sys
sys.path.insert(0, {tests!r})
from probe_kernels import probe_spec
from ptxattn import runtime
from ptxattn.__main__ import main
from ptxattn.tools import kernels

specs = [probe_spec(f"variant_{{i}}", "tma_copy_probe.cu", "tma_copy_probe", archs=("sm_90a",))
         for i in range(5000)]
kernels.all_variants = lambda arch: specs
runtime.compile = lambda spec, arch: runtime.CompiledKernel(
    spec, arch, b"", runtime.PtxasReport(64, 0, 0, 0, 0), "")
sys.exit(main(["kernels", "--arch", "sm_90a", "--jobs", "0"]))
"""


def test_kernels_piped_into_a_reader_that_stops_early_exits_quietly():
    """python -m ptxattn kernels | head -1: no traceback, and the status of a SIGPIPE."""
    code = PIPED_RUN.format(tests=str(Path(__file__).resolve().parent))
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1]) as run:
        assert run.stdout.readline().startswith(b"variant ")
        run.stdout.close()
        err = run.stderr.read().decode()
        status = run.wait(timeout=120)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "BrokenPipeError" not in err, err
    assert status == kernels.BROKEN_PIPE_STATUS, err
