"""The profiler's --energy (ptxattn/tools/profile.py): refused beside --backward and --serving before any timing, and
its lines name each measured runner of a row (runners without energy fields left out)."""

import pytest

from test_profile_plot import _profiler


def test_energy_is_refused_with_the_backward_and_serving_runs(capsys):
    profiler = _profiler()
    for mode in ("--backward", "--serving"):
        with pytest.raises(SystemExit):
            profiler.main([mode, "--energy"])
        assert "--energy measures the forward rows" in capsys.readouterr().err


def test_energy_lines_give_each_measured_runner_of_a_row():
    profiler = _profiler()
    row = dict(batch=4, seqlen=4096, heads=32, heads_kv=8, head_dim=128, causal=True,
               **{"ptxattn-hopper": 600.0, "fa3": 610.0, "torch-sdpa-flash": 300.0,
                  "ptxattn-hopper TFLOP/J": 0.83, "ptxattn-hopper W": 689.0,
                  "ptxattn-hopper MHz": 1401.0, "fa3 TFLOP/J": 0.8301, "fa3 W": 708.0,
                  "fa3 MHz": 1377.0})
    (line,) = profiler.energy_lines([row])
    assert line == ("4x4096x32/8x128 causal: ptxattn-hopper 0.830 TFLOP/J 689 W 1401 MHz, "
                    "fa3 0.830 TFLOP/J 708 W 1377 MHz")
