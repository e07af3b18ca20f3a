"""What ptxattn finds on this machine, for a first install or a bug report.

    python -m ptxattn.doctor

Prints the versions of ptxattn, CuPy (and the CUDA runtime it runs on), cuda-bindings and NVRTC;
the compile cache's directory with its size; the NVIDIA driver; and each GPU with its compile
target and the kernel families and inputs that run there. Exits non-zero, saying what to
install, when there is no NVIDIA driver, the driver is older than CUDA 13 needs, or no GPU is
one ptxattn runs on.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import cupy
from cuda import bindings

from .. import __version__, archs, dispatch, runtime


def _driver_release() -> str | None:
    """The driver's release number (580.65.06) from NVML, or None where NVML cannot say."""
    try:
        from cuda.bindings import nvml
        nvml.init_v2()
        try:
            return nvml.system_get_driver_version()
        finally:
            nvml.shutdown()
    except Exception:  # the release is only informative: a missing NVML or symbol is no error
        return None


def _gpus() -> list[tuple[int, str, tuple[int, int]]]:
    """(index, name, compute capability) of every GPU CuPy sees."""
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:  # cudaErrorNoDevice: a driver, but no GPU in view
        return []
    found = []
    for index in range(count):
        name = cupy.cuda.runtime.getDeviceProperties(index)["name"]
        major, minor = cupy.cuda.Device(index).compute_capability
        found.append((index, name.decode() if isinstance(name, bytes) else name,
                      (int(major), int(minor))))
    return found


def _cache_summary(root: Path) -> str:
    if not root.is_dir():
        return f"{root} (not created yet)"
    entries = list(root.glob("*.cubin"))
    size = sum(entry.stat().st_size for entry in entries)
    writable = "" if os.access(root, os.W_OK) else ", not writable: kernels stay in memory"
    return f"{root} ({len(entries)} entries, {size / 2**20:.1f} MiB{writable})"


def _routes(arch: str) -> list[str]:
    """What runs on ``arch``: one line per dispatch route (family, formats, head dims)."""
    lines = []
    for route in dispatch.TABLE:
        if arch not in route.archs:
            continue
        build = " (emulated)" if route.emulated else ""
        features = ", ".join(sorted(route.features))
        lines.append(f"{route.family}{build}: {', '.join(route.formats)}; head_dim "
                     f"{', '.join(map(str, route.head_dims))}; {features}")
    return lines


def main() -> int:
    """Prints what ptxattn finds; the exit status (0 when a GPU ptxattn runs on is there)."""
    print(f"ptxattn {__version__} at {Path(__file__).resolve().parent}")
    print(f"Python {sys.version.split()[0]}")
    print(f"CuPy {cupy.__version__} (CUDA runtime "
          f"{runtime.cuda_version_text(cupy.cuda.runtime.runtimeGetVersion())})")
    print(f"cuda-bindings {bindings.__version__}")
    print("NVRTC {}.{}".format(*runtime.nvrtc_version()))
    print(f"compile cache: {_cache_summary(runtime.cache_dir())}")

    try:
        driver_cuda = runtime.check_driver()
    except runtime.CudaError as err:
        print(f"NVIDIA driver: {err}")
        return 1
    release = _driver_release()
    print(f"NVIDIA driver {release or '(release unknown)'}, for CUDA "
          f"{runtime.cuda_version_text(driver_cuda)}")

    gpus = _gpus()
    if not gpus:
        print("no GPU visible (CUDA_VISIBLE_DEVICES?)")
        return 1
    runnable = 0
    for index, name, (major, minor) in gpus:
        try:
            arch = archs.arch_for_capability(major, minor)
        except archs.UnsupportedGpuError as err:
            print(f"GPU {index}: {name}, compute capability {major}.{minor}: {err}")
            continue
        runnable += 1
        print(f"GPU {index}: {name}, compute capability {major}.{minor}, compiles for {arch}")
        for line in _routes(arch):
            print(f"  {line}")
    return 0 if runnable else 1


if __name__ == "__main__":
    sys.exit(main())
