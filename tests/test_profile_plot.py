"""The profiler's --plot (ptxattn/tools/profile.py): the drawing of result rows (with
matplotlib, skipped without it) and the early exit, before any timing, where matplotlib is
missing."""

import sys

import pytest


def _profiler():
    from ptxattn.tools import profile
    return profile


def _rows():
    """Rows as the forward sweep writes them: a fixed shape, then batch * seqlen = 16384 and
    heads * head_dim = 2048, with runners missing from some rows."""
    rows = [dict(batch=4, seqlen=2048, heads=32, head_dim=128, causal=False,
                 **{"ptxattn-hopper": 600.0, "torch-sdpa-cudnn": 590.0, "fa3": None})]
    for head_dim in (64, 128):
        for seqlen in (512, 2048, 8192):
            for causal in (False, True):
                speed = (seqlen / 20 + head_dim) * (0.6 if causal else 1)
                rows.append(dict(batch=16384 // seqlen, seqlen=seqlen, heads=2048 // head_dim,
                                 head_dim=head_dim, causal=causal,
                                 **{"ptxattn-hopper": speed, "ptxattn-portable": speed / 2,
                                    "torch-sdpa-cudnn": speed * 0.9,
                                    "fa3": speed * 1.1 if head_dim == 128 else None}))
    return rows


def test_plot_draws_the_sweep_rows_into_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "profile.png"
    _profiler().plot_rows(_rows(), str(path), "test GPU (sm_90a), bfloat16, forward")
    assert path.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_plot_without_matplotlib_says_what_to_install_before_timing(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert _profiler().main(["--plot", "out.png"]) == 2
    assert "pip install 'ptxattn[plot]'" in capsys.readouterr().err


def test_plot_refuses_the_serving_run(capsys):
    with pytest.raises(SystemExit):
        _profiler().main(["--serving", "--plot", "out.png"])
    assert "--plot draws the forward or --backward sweep" in capsys.readouterr().err


def test_backward_rows_plot_without_the_forward_grids_fields():
    """--backward rows have no heads_kv (the targets grid's GQA field): plotting them must not
    ask for it."""
    profiler = _profiler()
    results = [dict(cfg, backward={"ptxattn-hopper": 400.0, "torch-sdpa-cudnn": None})
               for cfg in profiler.backward_configs(quick=True)]
    rows = profiler.backward_plot_rows(results)
    assert [row["head_dim"] for row in rows] == [cfg["head_dim"] for cfg in results]
    assert all("heads_kv" not in row and row["ptxattn-hopper"] == 400.0 for row in rows)


def test_the_targets_grid_is_refused_with_another_run(capsys):
    with pytest.raises(SystemExit):
        _profiler().main(["--grid", "targets", "--backward"])
    assert "--grid targets is a forward grid of its own" in capsys.readouterr().err
