"""The driver check every way onto the GPU passes through, and `python -m ptxattn doctor`, with
the driver and the GPUs stood in for (no GPU needed)."""

import json

import pytest

import ptxattn
from ptxattn import runtime
from ptxattn.tools import doctor
from test_runtime import PROBE


class FakeDriver:
    """cuda.bindings.driver as far as check_driver asks it: the CUDA version the driver speaks,
    or, for None, no libcuda to load (what cuda.bindings raises then)."""

    def __init__(self, cuda_version: int | None):
        self.cuda_version = cuda_version

    def cuDriverGetVersion(self):
        if self.cuda_version is None:
            raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via '
                               "system search. Ensure the NVIDIA display driver is installed.")
        return 0, self.cuda_version


@pytest.fixture
def driver(monkeypatch):
    """Installs a FakeDriver speaking the given CUDA version (None: no driver)."""
    def install(cuda_version: int | None) -> None:
        monkeypatch.setattr(runtime, "_driver", lambda: FakeDriver(cuda_version))
        runtime.check_driver.cache_clear()

    yield install
    runtime.check_driver.cache_clear()


def test_an_old_driver_is_told_to_install_580_at_every_way_onto_the_gpu(driver):
    driver(12080)
    for way_in in (runtime.check_driver, runtime.device_arch, lambda: runtime.load(PROBE)):
        with pytest.raises(runtime.CudaError, match="supports CUDA 12.8") as info:
            way_in()
        assert "install NVIDIA driver 580 or newer" in str(info.value)


def test_no_driver_is_said_plainly(driver):
    driver(None)
    with pytest.raises(runtime.CudaError, match="no NVIDIA driver found.*driver 580 or newer"):
        runtime.device_arch()


def test_a_cuda_13_driver_passes(driver):
    driver(13000)
    assert runtime.check_driver() == 13000


def test_doctor_without_a_driver_reports_the_rest_and_fails(driver, capsys):
    driver(None)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    for expected in ("ptxattn ", "CuPy ", "cuda-bindings ", "NVRTC 13.", "compile cache: ",
                     "no NVIDIA driver found"):
        assert expected in out


def test_doctor_with_an_old_driver_says_what_to_install(driver, capsys):
    driver(12040)
    assert doctor.main([]) == 1
    assert "supports CUDA 12.4" in capsys.readouterr().out


def test_doctor_lists_each_gpu_with_its_arch_and_what_runs_there(driver, monkeypatch, capsys):
    driver(13000)
    monkeypatch.setattr(doctor, "_driver_release", lambda: "580.65.06")
    monkeypatch.setattr(doctor, "_gpus", lambda: [(0, "NVIDIA H100 80GB HBM3", (9, 0)),
                                                  (1, "Tesla V100-SXM2-16GB", (7, 0))])
    assert doctor.main([]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA driver 580.65.06, for CUDA 13.0" in out
    assert "GPU 0: NVIDIA H100 80GB HBM3, compute capability 9.0, compiles for sm_90a" in out
    gpu0 = out.split("GPU 0:")[1].split("GPU 1:")[0]
    assert "  hopper: bfloat16, float16; head_dim 64, 128, 256" in gpu0
    assert "  hopper: e4m3;" in gpu0
    assert "  portable: bfloat16, float16; head_dim 64, 128, 256; backward, causal, gqa" in gpu0
    assert "  blockscaled (emulated): mxfp8, nvfp4" in gpu0
    assert "GPU 1: Tesla V100-SXM2-16GB, compute capability 7.0: ptxattn needs" in out


def test_doctor_fails_when_no_gpu_is_one_ptxattn_runs_on(driver, monkeypatch, capsys):
    driver(13000)
    monkeypatch.setattr(doctor, "_driver_release", lambda: None)
    monkeypatch.setattr(doctor, "_gpus", lambda: [(0, "Tesla V100-SXM2-16GB", (7, 0))])
    assert doctor.main([]) == 1
    assert "NVIDIA driver (release unknown), for CUDA 13.0" in capsys.readouterr().out


def _two_gpus(monkeypatch):
    monkeypatch.setattr(doctor, "_driver_release", lambda: "580.65.06")
    monkeypatch.setattr(doctor, "_gpus", lambda: [(0, "NVIDIA H100 80GB HBM3", (9, 0)),
                                                  (1, "Tesla V100-SXM2-16GB", (7, 0))])


def test_doctor_help_exits_0(capsys):
    with pytest.raises(SystemExit) as info:
        doctor.main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m ptxattn doctor") and "--json" in out


def test_doctor_json_without_a_driver_is_parseable_and_fails(driver, capsys):
    driver(None)
    assert doctor.main(["--json"]) == 1
    found = json.loads(capsys.readouterr().out)
    assert found["ok"] is False
    assert found["version"] == ptxattn.__version__
    assert found["nvrtc"].startswith("13.")
    for key in ("python", "cupy", "cuda_runtime", "cuda_bindings"):
        assert found[key], key
    assert found["cache"]["dir"] == str(runtime.cache_dir())
    assert found["driver"] is None and found["gpus"] == []
    assert "no NVIDIA driver found" in found["problem"]


def test_doctor_json_lists_each_gpu_with_its_arch_and_routes(driver, monkeypatch, capsys):
    driver(13000)
    _two_gpus(monkeypatch)
    assert doctor.main(["--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["ok"] is True and found["problem"] is None
    assert found["driver"] == {"release": "580.65.06", "cuda": "13.0"}
    h100, v100 = found["gpus"]
    assert (h100["name"], h100["compute_capability"], h100["arch"]) == (
        "NVIDIA H100 80GB HBM3", "9.0", "sm_90a")
    portable = {"family": "portable", "emulated": False, "formats": ["bfloat16", "float16"],
                "head_dims": [64, 128, 256],
                "features": ["backward", "causal", "gqa", "sinks", "softcap", "varlen", "window"]}
    assert portable in h100["routes"]
    assert any(r["family"] == "blockscaled" and r["emulated"] for r in h100["routes"])
    assert v100["arch"] is None and v100["routes"] == [] and "ptxattn needs" in v100["error"]


def test_a_fact_that_cannot_be_read_is_reported_beside_the_others(driver, monkeypatch, capsys):
    driver(None)

    def broken():
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(doctor, "_nvrtc", broken)
    assert doctor.main([]) == 1
    out = capsys.readouterr().out
    assert "NVRTC unknown (OSError: libnvrtc.so.13: cannot open shared object file)" in out
    assert "cuda-bindings " in out and "no NVIDIA driver found" in out


def test_summary_without_a_driver_says_why_and_does_not_raise(driver, capsys):
    driver(None)
    assert doctor.summary() is False
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith(f"ptxattn {ptxattn.__version__} (Python ")
    assert second.startswith("NVIDIA driver: no NVIDIA driver found")


def test_summary_names_each_gpu_and_its_arch(driver, monkeypatch, capsys):
    driver(13000)
    _two_gpus(monkeypatch)
    assert doctor.summary() is True
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == [
        "NVIDIA driver 580.65.06, for CUDA 13.0",
        "GPU 0: NVIDIA H100 80GB HBM3, compute capability 9.0, compiles for sm_90a"]
    assert lines[3].startswith("GPU 1: Tesla V100-SXM2-16GB, compute capability 7.0: ptxattn "
                               "needs")
    assert len(lines) == 4  # no routes: those are the doctor's


def test_summary_with_a_driver_but_no_gpu(driver, monkeypatch, capsys):
    driver(13000)
    monkeypatch.setattr(doctor, "_driver_release", lambda: None)
    monkeypatch.setattr(doctor, "_gpus", lambda: [])
    assert doctor.summary() is False
    assert capsys.readouterr().out.splitlines()[-1] == doctor.NO_GPU


def test_summary_survives_a_doctor_that_fails(monkeypatch, capsys):
    def broken():
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(doctor, "facts", broken)
    assert doctor.summary() is False
    assert "something unforeseen" in capsys.readouterr().out


def test_gpu_problem_names_the_missing_driver_or_the_missing_gpu(driver, monkeypatch):
    import cupy
    driver(None)
    assert "no NVIDIA driver found" in doctor.gpu_problem()
    driver(13000)
    monkeypatch.setattr(cupy, "is_available", lambda: False)
    assert "CuPy sees no GPU" in doctor.gpu_problem()
    monkeypatch.setattr(cupy, "is_available", lambda: True)
    assert doctor.gpu_problem() is None
