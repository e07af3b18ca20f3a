"""What ptxattn finds on this machine, for a first install or a bug report.

    python -m ptxattn doctor [--json]

Prints the versions of ptxattn, CuPy (and the CUDA runtime it runs on), cuda-bindings and NVRTC;
the compile cache's directory with its size; the NVIDIA driver; and each GPU with its compile
target and the kernel families and inputs that run there. --json prints the same facts as one
JSON object, with "ok" saying whether a GPU ptxattn runs on is there. Exits non-zero, saying what
to install, when there is no NVIDIA driver, the driver is older than CUDA 13 needs, or no GPU is
one ptxattn runs on; whatever it can find it prints all the same.

``python -m ptxattn`` prints a short form of it (summary()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from .. import __version__, archs, dispatch, runtime
from .kernels import quiet_on_broken_pipe

NO_GPU = "no GPU visible (CUDA_VISIBLE_DEVICES?)"


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
    import cupy
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


def _attempt(what: Callable[[], object]) -> tuple[object, str | None]:
    """(what(), None), or (None, the error) where it raised: one missing fact is no reason to
    stop reporting the others."""
    try:
        return what(), None
    except Exception as err:
        return None, f"{type(err).__name__}: {err}"


def _cupy_version() -> str:
    import cupy
    return cupy.__version__


def _cuda_runtime() -> str:
    import cupy
    return runtime.cuda_version_text(cupy.cuda.runtime.runtimeGetVersion())


def _cuda_bindings() -> str:
    from cuda import bindings
    return bindings.__version__


def _nvrtc() -> str:
    return "{}.{}".format(*runtime.nvrtc_version())


def _cache(root: Path) -> dict:
    if not root.is_dir():
        return {"dir": str(root), "exists": False, "entries": 0, "bytes": 0, "writable": None}
    entries = list(root.glob("*.cubin"))
    return {"dir": str(root), "exists": True, "entries": len(entries),
            "bytes": sum(entry.stat().st_size for entry in entries),
            "writable": os.access(root, os.W_OK)}


def _cache_text(cache: dict) -> str:
    if not cache["exists"]:
        return f"{cache['dir']} (not created yet)"
    writable = "" if cache["writable"] else ", not writable: kernels stay in memory"
    return (f"{cache['dir']} ({cache['entries']} entries, {cache['bytes'] / 2**20:.1f} "
            f"MiB{writable})")


def _routes(arch: str) -> list[dict]:
    """What runs on ``arch``: one entry per dispatch route (family, formats, head dims)."""
    return [{"family": route.family, "emulated": route.emulated, "formats": list(route.formats),
             "head_dims": list(route.head_dims), "features": sorted(route.features)}
            for route in dispatch.TABLE if arch in route.archs]


def _route_text(route: dict) -> str:
    build = " (emulated)" if route["emulated"] else ""
    return (f"{route['family']}{build}: {', '.join(route['formats'])}; head_dim "
            f"{', '.join(map(str, route['head_dims']))}; {', '.join(route['features'])}")


def facts() -> dict:
    """Everything the doctor reports, as JSON-ready values; never raises. A version that could
    not be read is None, with the error under "errors"; "problem" says why "ok" is false."""
    found = {"version": __version__, "location": str(Path(__file__).resolve().parents[1]),
             "python": sys.version.split()[0]}
    errors = {}
    for key, read in (("cupy", _cupy_version), ("cuda_runtime", _cuda_runtime),
                      ("cuda_bindings", _cuda_bindings), ("nvrtc", _nvrtc),
                      ("cache", lambda: _cache(runtime.cache_dir()))):
        found[key], error = _attempt(read)
        if error:
            errors[key] = error
    found.update(driver=None, gpus=[], ok=False, problem=None, errors=errors)
    try:
        driver_cuda = runtime.check_driver()
    except Exception as err:  # CudaError: none, or too old; anything else: say it as well
        found["problem"] = f"NVIDIA driver: {err}"
        return found
    found["driver"] = {"release": _driver_release(),
                       "cuda": runtime.cuda_version_text(driver_cuda)}
    gpus, error = _attempt(_gpus)
    if error:
        errors["gpus"] = error
    for index, name, (major, minor) in gpus or []:
        gpu = {"index": index, "name": name, "compute_capability": f"{major}.{minor}",
               "arch": None, "routes": [], "error": None}
        try:
            gpu["arch"] = archs.arch_for_capability(major, minor)
            gpu["routes"] = _routes(gpu["arch"])
        except archs.UnsupportedGpuError as err:
            gpu["error"] = str(err)
        found["gpus"].append(gpu)
    found["ok"] = any(gpu["arch"] for gpu in found["gpus"])
    if not found["gpus"]:
        found["problem"] = NO_GPU if error is None else f"no GPU: {error}"
    elif not found["ok"]:
        found["problem"] = "no GPU here is one ptxattn runs on"
    return found


def gpu_problem() -> str | None:
    """Why nothing can run on a GPU here (no driver, a driver too old, CuPy seeing no GPU), or
    None when CuPy sees one: for the commands that need a GPU to say before they start."""
    try:
        runtime.check_driver()
    except (runtime.CudaError, ImportError) as err:  # ImportError: no cuda-bindings
        return str(err)
    try:
        import cupy
    except ImportError as err:
        return f"CuPy does not import ({err})"
    if not cupy.is_available():
        return "the NVIDIA driver is there, but CuPy sees no GPU (CUDA_VISIBLE_DEVICES?)"
    return None


def _gpu_line(gpu: dict, routes: bool) -> list[str]:
    head = f"GPU {gpu['index']}: {gpu['name']}, compute capability {gpu['compute_capability']}"
    if gpu["error"]:
        return [f"{head}: {gpu['error']}"]
    return [f"{head}, compiles for {gpu['arch']}"] + (
        [f"  {_route_text(route)}" for route in gpu["routes"]] if routes else [])


def _driver_lines(found: dict) -> list[str]:
    if found["driver"] is None:
        return [found["problem"]]
    driver = found["driver"]
    lines = [f"NVIDIA driver {driver['release'] or '(release unknown)'}, for CUDA "
             f"{driver['cuda']}"]
    if not found["gpus"]:
        lines.append(found["problem"])
    return lines


def _or_error(found: dict, key: str) -> str:
    return found[key] if found[key] is not None else f"unknown ({found['errors'][key]})"


def report(found: dict) -> list[str]:
    """The doctor's lines for ``facts()``."""
    lines = [f"ptxattn {found['version']} at {found['location']}",
             f"Python {found['python']}",
             f"CuPy {_or_error(found, 'cupy')} (CUDA runtime {_or_error(found, 'cuda_runtime')})",
             f"cuda-bindings {_or_error(found, 'cuda_bindings')}",
             f"NVRTC {_or_error(found, 'nvrtc')}",
             "compile cache: " + (_cache_text(found["cache"]) if found["cache"] is not None
                                  else _or_error(found, "cache"))]
    lines += _driver_lines(found)
    for gpu in found["gpus"]:
        lines += _gpu_line(gpu, routes=True)
    return lines


def summary() -> bool:
    """Prints the short form (the version, the driver, each GPU and its arch, or why there is
    none); whether a GPU ptxattn runs on is there. Never raises."""
    try:
        found = facts()
        nvrtc = f", NVRTC {found['nvrtc']}" if found["nvrtc"] else ""
        lines = [f"ptxattn {found['version']} (Python {found['python']}{nvrtc})"]
        lines += _driver_lines(found)
        for gpu in found["gpus"]:
            lines += _gpu_line(gpu, routes=False)
        ok = found["ok"]
    except Exception as err:  # a summary is no place to fail
        lines, ok = [f"ptxattn {__version__}", f"(the doctor failed: {err})"], False
    print("\n".join(lines))
    return ok


@quiet_on_broken_pipe
def main(argv: list[str] | None = None) -> int:
    """Prints what ptxattn finds; the exit status (0 when a GPU ptxattn runs on is there)."""
    parser = argparse.ArgumentParser(prog="python -m ptxattn doctor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true",
                        help="print the facts as one JSON object instead")
    args = parser.parse_args(argv)
    found = facts()
    print(json.dumps(found, indent=1) if args.json else "\n".join(report(found)))
    return 0 if found["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
