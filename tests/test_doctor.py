"""The driver check every way onto the GPU passes through, and `python -m ptxattn.doctor`, with
the driver and the GPUs stood in for (no GPU needed)."""

import pytest

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
    assert doctor.main() == 1
    out = capsys.readouterr().out
    for expected in ("ptxattn ", "CuPy ", "cuda-bindings ", "NVRTC 13.", "compile cache: ",
                     "no NVIDIA driver found"):
        assert expected in out


def test_doctor_with_an_old_driver_says_what_to_install(driver, capsys):
    driver(12040)
    assert doctor.main() == 1
    assert "supports CUDA 12.4" in capsys.readouterr().out


def test_doctor_lists_each_gpu_with_its_arch_and_what_runs_there(driver, monkeypatch, capsys):
    driver(13000)
    monkeypatch.setattr(doctor, "_driver_release", lambda: "580.65.06")
    monkeypatch.setattr(doctor, "_gpus", lambda: [(0, "NVIDIA H100 80GB HBM3", (9, 0)),
                                                  (1, "Tesla V100-SXM2-16GB", (7, 0))])
    assert doctor.main() == 0
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
    assert doctor.main() == 1
    assert "NVIDIA driver (release unknown), for CUDA 13.0" in capsys.readouterr().out
