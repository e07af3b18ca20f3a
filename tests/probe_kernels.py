"""The probe kernels of the tests (tests/probes/*.cu): small kernels that exercise one device
header each, compiled from beside the tests rather than shipped with the package."""

from pathlib import Path

from ptxattn import runtime

PROBE_DIR = Path(__file__).resolve().parent / "probes"


def probe_spec(name: str, source: str, entry: str, archs: tuple[str, ...], *,
               smem_bytes: int = 0, defines: dict | None = None) -> runtime.KernelSpec:
    """The KernelSpec of a probe kernel in tests/probes/``source``."""
    return runtime.KernelSpec(name, str(PROBE_DIR / source), entry, defines=defines or {},
                              smem_bytes=smem_bytes, archs=archs)
