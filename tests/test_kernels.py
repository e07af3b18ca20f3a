"""Every kernel variant ptxattn ships compiles for every target, within its budgets, on a
machine with no GPU (NVRTC only)."""

import json

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
