"""timing.time_ms_interleaved's turns, on a stand-in for CuPy's events (no GPU needed)."""
import sys
import types

from ptxattn import timing


def _fake_cupy(log):
    """Events whose elapsed time is the number of calls logged between them."""
    class Event:
        def record(self):
            self.at = len(log)

        def synchronize(self):
            pass

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
