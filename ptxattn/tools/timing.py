"""GPU timing shared by the profiler and the tuning scripts, and energy per call through NVML."""

from __future__ import annotations

import ctypes
import dataclasses
import random
import statistics
import threading
import time


def time_ms(fn, warmup: int = 3, repeats: int = 15, launches: int = 10) -> float:
    """Median over ``repeats`` CUDA-event-timed samples of the mean time of ``launches``
    back-to-back calls of ``fn`` on the current stream, after ``warmup`` calls. Back-to-back
    calls let each call's host-side work overlap the previous call's GPU work, as in real use."""
    return time_ms_interleaved({None: fn}, warmup, repeats, launches)[None]


def time_ms_interleaved(fns: dict, warmup: int = 3, repeats: int = 15,
                        launches: int = 10, seed: int = 0) -> dict:
    """time_ms of each function of ``fns`` (name -> callable), sampled in turns: round r times
    every function once, in an order shuffled every round (from ``seed``, so a run repeats its
    turns). A GPU's clock follows its temperature and power draw, which the previous work set,
    so a sample inherits the state its predecessor left: timing one function after the other
    would hand each its own, and turns in a fixed order (even reversed every other round) hand
    each function the same neighbours every round. On a power-capped H100 the same kernel
    timed beside a peer read up to 8% slower than in the next place of such turns
    (docs/design/measurement.md#timing-turns-shuffled); shuffled turns give every function every
    neighbour."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    order = list(fns.items())
    turns = random.Random(seed)
    for _ in range(repeats):
        for name, fn in turns.sample(order, len(order)):
            start.record()
            for _ in range(launches):
                fn()
            stop.record()
            stop.synchronize()
            times[name].append(cupy.cuda.get_elapsed_time(start, stop) / launches)
    return {name: statistics.median(samples) for name, samples in times.items()}


@dataclasses.dataclass(frozen=True)
class EnergySample:
    """A function run alone for a sustained window: mean time and energy per call, mean board
    power and mean SM clock over the window."""

    ms: float
    joules: float
    watts: float
    sm_mhz: float


class Nvml:
    """One GPU's total-energy counter (millijoules since the driver loaded) and SM clock, read
    from NVML's C library, which the NVIDIA driver installs, through ctypes (no Python package)."""

    _CLOCK_SM = 1  # nvmlClockType_t NVML_CLOCK_SM

    def __init__(self, lib, handle):
        self._lib = lib
        self._handle = handle

    @classmethod
    def open(cls, pci_bus_id: str) -> Nvml | None:
        """NVML for the GPU at ``pci_bus_id`` (as CuPy's ``Device.pci_bus_id`` gives it), or None
        where the library, the GPU or its energy counter (Volta and newer) is not there."""
        for name in ("libnvidia-ml.so.1", "nvml.dll"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError:
                continue
        else:
            return None
        handle = ctypes.c_void_p()
        if (lib.nvmlInit_v2() != 0 or lib.nvmlDeviceGetHandleByPciBusId_v2(
                pci_bus_id.encode(), ctypes.byref(handle)) != 0):
            return None
        nvml = cls(lib, handle)
        try:
            nvml.energy_mj()
        except OSError:
            return None
        return nvml

    def energy_mj(self) -> int:
        value = ctypes.c_ulonglong()
        status = self._lib.nvmlDeviceGetTotalEnergyConsumption(self._handle, ctypes.byref(value))
        if status != 0:
            raise OSError(f"nvmlDeviceGetTotalEnergyConsumption returned {status}")
        return value.value

    def sm_clock_mhz(self) -> int:
        value = ctypes.c_uint()
        status = self._lib.nvmlDeviceGetClockInfo(self._handle, self._CLOCK_SM, ctypes.byref(value))
        if status != 0:
            raise OSError(f"nvmlDeviceGetClockInfo returned {status}")
        return value.value


def energy_per_call_interleaved(fns: dict, nvml, window_s: float = 2.0, rounds: int = 2,
                                seed: int = 0, clock_period_s: float = 0.01) -> dict:
    """EnergySample of each function of ``fns`` (name -> callable): each runs alone, back to
    back, for about ``window_s`` seconds after a fifth of that to reach its own steady state,
    while ``nvml`` (an Nvml) gives the energy spent and the SM clock every ``clock_period_s``;
    the functions take their windows in shuffled turns (as time_ms_interleaved), ``rounds``
    times, and each field is the median over them. NVML's counter moves in steps, and a
    power-capped GPU's clock settles in tenths of a second, so windows are seconds long (windows
    of 1.5 s on the H100 read up to 718 W under its 700 W cap, 2026-11-26:
    docs/design/measurement.md#energy-per-call)."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    calls = {}
    for name, fn in fns.items():
        fn()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        calls[name] = max(1, round(window_s * 1e3 / max(cupy.cuda.get_elapsed_time(start, stop),
                                                        1e-3)))
    samples = {name: [] for name in fns}
    order = list(fns.items())
    turns = random.Random(seed)
    for _ in range(rounds):
        for name, fn in turns.sample(order, len(order)):
            count = calls[name]
            for _ in range(max(1, count // 5)):
                fn()
            stop.record()
            stop.synchronize()  # the settling calls' energy stays out of the window
            clocks, done = [], threading.Event()

            def poll():
                try:
                    while not done.wait(clock_period_s):
                        clocks.append(nvml.sm_clock_mhz())
                except OSError:
                    return  # the window's clock is then the samples taken, else read after it

            poller = threading.Thread(target=poll)
            poller.start()
            began, energy = time.perf_counter(), nvml.energy_mj()
            start.record()
            for _ in range(count):
                fn()
            stop.record()
            stop.synchronize()
            joules, seconds = (nvml.energy_mj() - energy) / 1e3, time.perf_counter() - began
            done.set()
            poller.join()
            samples[name].append(EnergySample(
                ms=cupy.cuda.get_elapsed_time(start, stop) / count, joules=joules / count,
                watts=joules / seconds,
                sm_mhz=statistics.mean(clocks) if clocks else nvml.sm_clock_mhz()))
    return {name: EnergySample(*(statistics.median(getattr(sample, field.name)
                                                   for sample in taken)
                                 for field in dataclasses.fields(EnergySample)))
            for name, taken in samples.items()}


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool) -> float:
    """4 * B * H * Sq * Sk * D (two GEMMs of 2 flops per multiply-add), halved for causal."""
    total = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return total / 2 if causal else total
