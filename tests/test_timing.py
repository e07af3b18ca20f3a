"""timing: time_ms_interleaved's turns and energy_per_call_interleaved's windows, on stand-ins for
CuPy's events and NVML (no GPU needed)."""
import sys
import types

import pytest

from ptxattn.tools import timing


def _fake_cupy(log, synced=None):
    """Events whose elapsed time is the number of calls logged between them; ``synced`` (a
    list) gets the number of calls logged at each synchronize, as a GPU would have run them."""
    class Event:
        def record(self):
            self.at = len(log)

        def synchronize(self):
            if synced is not None:
                synced.append(self.at)

    cuda = types.SimpleNamespace(Event=Event,
                                 get_elapsed_time=lambda start, stop: float(stop.at - start.at))
    return types.SimpleNamespace(cuda=cuda)


def test_every_function_is_timed_once_a_round_after_ever_changing_neighbours(monkeypatch):
    log = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log))
    names = "abcde"
    fns = {name: (lambda name=name: log.append(name)) for name in names}
    ms = timing.time_ms_interleaved(fns, warmup=1, repeats=12, launches=3)

    assert ms == {name: 1.0 for name in names}
    timed = log[len(names):]  # after one warm-up call each
    rounds = ["".join(timed[i:i + 3 * len(names):3])
              for i in range(0, len(timed), 3 * len(names))]
    assert len(rounds) == 12 and all(sorted(r) == list(names) for r in rounds)
    # A fixed order, even reversed every other round, keeps each function's neighbours; the
    # shuffled turns put every function after several others.
    after = {name: {r[r.index(name) - 1] for r in rounds if r.index(name) > 0} for name in names}
    assert all(len(before) >= 2 for before in after.values()), after


def test_the_turns_repeat_for_a_seed(monkeypatch):
    runs = []
    for _ in range(2):
        log = []
        monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log))
        timing.time_ms_interleaved({n: (lambda n=n: log.append(n)) for n in "abcd"}, warmup=0,
                                   repeats=6, launches=1)
        runs.append(log)
    assert runs[0] == runs[1]


class _FakeNvml:
    """An energy counter that has spent ``mj_per_call[name]`` millijoules on each call the GPU
    has run: those logged before the last synchronize (later ones may still be queued)."""

    def __init__(self, log, synced, mj_per_call):
        self.log, self.synced, self.mj_per_call = log, synced, mj_per_call

    def energy_mj(self):
        return sum(self.mj_per_call[name] for name in self.log[:self.synced[-1]])

    def sm_clock_mhz(self):
        return 1500


def test_energy_per_call_counts_only_each_functions_own_window(monkeypatch):
    log, synced = [], [0]
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(log, synced))
    nvml = _FakeNvml(log, synced, {"a": 5, "b": 7, "c": 11})
    fns = {name: (lambda name=name: log.append(name)) for name in "abc"}
    # one call reads 1 "ms" on the stand-in events, so a 20 ms window is 20 calls
    energy = timing.energy_per_call_interleaved(fns, nvml, window_s=0.02, rounds=3,
                                                clock_period_s=0.001)

    assert {name: e.joules for name, e in energy.items()} == pytest.approx(
        {"a": 0.005, "b": 0.007, "c": 0.011})
    assert all(e.ms == 1.0 and e.sm_mhz == 1500 and e.watts > 0 for e in energy.values())
    # two calibration calls, then three rounds of 4 settling calls and 20 timed ones
    assert all(log.count(name) == 2 + 3 * (4 + 20) for name in "abc")


def test_nvml_is_none_without_its_library(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(timing.ctypes, "CDLL", no_library)
    assert timing.Nvml.open("0000:00:04.0") is None
