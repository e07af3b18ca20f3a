"""The GPU architectures ptxattn compiles for, and what each one can run: the one place for these
facts.

An architecture is named by its NVRTC compile target (``--gpu-architecture``). The "a" targets
(sm_90a, sm_100a, sm_103a, sm_120a, sm_121a) unlock that chip's own instructions (wgmma and
setmaxnreg on sm_90a; block-scaled mma.sync on sm_120a and sm_121a), and a CUBIN
built for one of them runs only on GPUs of exactly that compute capability, so every supported
capability has its own entry here.

Kernel families (their launchers in ptxattn/launchers/): "portable" (mma.sync, cp.async)
runs everywhere from sm_80; "hopper" (wgmma + TMA, also the FP8 path) only on sm_90a;
"blockscaled" natively where block-scaled mma.sync exists (sm_120a, sm_121a) and, as an exact
but slow emulation of that instruction, on sm_90a. Which family an attention call gets is
decided in dispatch.py from these lists.

Needs no GPU and imports nothing from ptxattn, so that every other module may import it.
"""

from __future__ import annotations

import dataclasses


class UnsupportedGpuError(RuntimeError):
    """The GPU is one ptxattn has no kernels for."""


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str                     # NVRTC compile target, e.g. "sm_90a"
    capability: tuple[int, int]   # compute capability (major, minor) of the GPUs it runs on
    smem_per_block: int           # largest dynamic + static shared memory of one block, bytes
    families: tuple[str, ...]     # kernel families built for it with the instructions they use
    # Kernel families built for it with an exact emulation of instructions it lacks: correct,
    # not fast (they exist to run the sm_120a code paths on a GPU this project has).
    emulated_families: tuple[str, ...] = ()


_KB = 1024

ARCHS: dict[str, Arch] = {arch.name: arch for arch in (
    Arch("sm_80", (8, 0), 163 * _KB, ("portable",)),
    Arch("sm_86", (8, 6), 99 * _KB, ("portable",)),
    Arch("sm_89", (8, 9), 99 * _KB, ("portable",)),
    Arch("sm_90a", (9, 0), 227 * _KB, ("portable", "hopper"), emulated_families=("blockscaled",)),
    Arch("sm_100a", (10, 0), 227 * _KB, ("portable",)),
    Arch("sm_103a", (10, 3), 227 * _KB, ("portable",)),
    Arch("sm_120a", (12, 0), 99 * _KB, ("portable", "blockscaled")),
    Arch("sm_121a", (12, 1), 99 * _KB, ("portable", "blockscaled")),
)}

# Largest dynamic + static shared memory one block may use, per compile target.
SMEM_LIMIT_BYTES = {name: arch.smem_per_block for name, arch in ARCHS.items()}


def get(name: str) -> Arch:
    """The architecture compiled for as ``name``, or a ValueError listing the known ones."""
    try:
        return ARCHS[name]
    except KeyError:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {name!r}") from None


def running(family: str, *, emulated: bool = False) -> tuple[str, ...]:
    """The architectures ``family`` is built for natively (or, with ``emulated``, as an
    emulation build), in the order of ARCHS."""
    return tuple(name for name, arch in ARCHS.items()
                 if family in (arch.emulated_families if emulated else arch.families))


def arch_for_capability(major: int, minor: int) -> str:
    """The compile target for GPUs of compute capability ``major.minor``: sm_{major}{minor},
    with the "a" suffix from 9.0 up (9.0 -> sm_90a, 10.0 -> sm_100a, 10.3 -> sm_103a,
    12.0 -> sm_120a, 12.1 -> sm_121a). Raises UnsupportedGpuError for a GPU below sm_80 or one
    not in ARCHS."""
    for arch in ARCHS.values():
        if arch.capability == (major, minor):
            return arch.name
    if (major, minor) < (8, 0):
        raise UnsupportedGpuError(
            f"ptxattn needs an NVIDIA GPU of compute capability 8.0 (sm_80, Ampere) or newer; "
            f"this one has {major}.{minor}")
    raise UnsupportedGpuError(
        f"ptxattn has no kernels for compute capability {major}.{minor}; it compiles for "
        + ", ".join(f"{arch.name} ({arch.capability[0]}.{arch.capability[1]})"
                    for arch in ARCHS.values()))
