"""The profiler's --backward --fp8 (ptxattn/tools/profile.py) without a GPU: its rows, the
options it is refused beside before any timing, its table, ratio and torch-op lines; and the
parts of its cuDNN peer (ptxattn/tools/cudnn_fp8.py) that need no GPU: the gradient scales from
cuDNN's amaxes, the layouts the graphs declare, where libcudnn is looked for, and the reason
given where torch is missing."""

import sys

import pytest

from ptxattn.tools import cudnn_fp8, profile
from test_doctor import driver  # noqa: F401  (a fixture: the NVIDIA driver stood in for)


def test_fp8_rows_are_16_heads_over_32k_tokens_at_three_head_dims():
    rows = profile.fp8_backward_configs(quick=False)
    assert len(rows) == 3 * 3 * 2
    assert {(r["head_dim"], r["seqlen"]) for r in rows} == {
        (d, s) for d in (128, 64, 256) for s in (4096, 8192, 16384)}
    assert all(r["batch"] * r["seqlen"] == 32768 and r["heads"] == 16 for r in rows)
    # each shape causal and not, head_dim 128 first
    assert [r["causal"] for r in rows[:2]] == [False, True] and rows[0]["head_dim"] == 128
    quick = profile.fp8_backward_configs(quick=True)
    assert quick == [r for r in rows if r["seqlen"] != 16384]
    assert profile.fp8_backward_configs(True, "128x2048,64x65536") == [
        dict(batch=16, seqlen=2048, heads=16, head_dim=128, causal=False),
        dict(batch=16, seqlen=2048, heads=16, head_dim=128, causal=True),
        dict(batch=1, seqlen=65536, heads=16, head_dim=64, causal=False),
        dict(batch=1, seqlen=65536, heads=16, head_dim=64, causal=True)]


def test_shapes_read_as_head_dim_by_seqlen_pairs():
    assert profile.parse_shapes("128x16384,64x2048") == [(128, 16384), (64, 2048)]


@pytest.mark.parametrize("argv, words", [
    (["--fp8"], "--fp8 picks the FP8 rows of --backward: add --backward"),
    (["--backward", "--fp8", "--dtype", "float16"], "rows are bfloat16"),
    (["--backward", "--fp8", "--plot", "x.png"], "not --serving, --backward-features or "
                                                 "--backward --fp8"),
])
def test_fp8_rows_are_refused_before_any_timing_beside_what_they_do_not_take(argv, words,
                                                                             capsys):
    with pytest.raises(SystemExit):
        profile.main(argv)
    assert words in capsys.readouterr().err


def test_fp8_rows_without_a_driver_say_so(driver, capsys):
    driver(None)
    assert profile.main(["--backward", "--fp8", "--quick"]) == 2
    assert "nothing to measure without a GPU" in capsys.readouterr().err


def _row(**backward):
    return dict(batch=4, seqlen=8192, heads=16, head_dim=128, causal=True, backward=backward)


def test_the_table_gives_each_runner_s_tflops_and_a_dash_where_one_did_not_run():
    header, line = profile.fp8_table_lines([_row(**{"ptxattn-fp8": 812.34,
                                                    "ptxattn-bf16": 540.0})])
    assert header.split() == ["batch", "seqlen", "heads", "dim", "causal", "ptxattn-fp8",
                              "ptxattn-bf16", "cudnn-fp8", "torch-sdpa-cudnn"]
    assert line.split() == ["4", "8192", "16", "128", "True", "812.3", "540.0", "-", "-"]
    # the cells line up under their names
    assert line.index("812.3") + len("812.3") == header.index("ptxattn-fp8") + len("ptxattn-fp8")


def test_a_ratio_line_gives_fp8_over_bf16_and_over_cudnn_fp8_where_both_ran():
    row = _row(**{"ptxattn-fp8": 800.0, "ptxattn-bf16": 500.0, "cudnn-fp8": 640.0})
    assert profile.fp8_ratio_line(row) == ("4x8192x16x128 causal: ptxattn-fp8 / ptxattn-bf16 "
                                           "1.600x, ptxattn-fp8 / cudnn-fp8 1.250x")
    assert profile.fp8_ratio_line(_row(**{"ptxattn-fp8": 800.0, "ptxattn-bf16": 500.0})) == (
        "4x8192x16x128 causal: ptxattn-fp8 / ptxattn-bf16 1.600x")
    assert profile.fp8_ratio_line(_row(**{"cudnn-fp8": 640.0})) == (
        "4x8192x16x128 causal: no ratio (ptxattn-fp8 or its peers did not run)")


def test_a_torch_ops_line_gives_each_op_s_time_and_fp8_s_over_bf16_s():
    # 3.5 x the causal forward's 4 * 4 * 16 * 8192^2 * 128 / 2 FLOPs in 4 ms
    work = 3.5 * 4 * 4 * 16 * 8192 ** 2 * 128 / 2
    row = dict(_row(), torch_ops_ms={"attention": 4.0, "fp8_attention": 3.0})
    assert profile.torch_ops_line(row) == (
        f"4x8192x16x128 causal: attention 4.000 ms ({work / 4e9:.1f} TFLOP/s), fp8_attention "
        f"3.000 ms ({work / 3e9:.1f} TFLOP/s); fp8_attention / attention time 0.750")
    assert profile.torch_ops_line(dict(_row(), torch_ops_ms={"attention": 4.0})) == (
        f"4x8192x16x128 causal: attention 4.000 ms ({work / 4e9:.1f} TFLOP/s)")
    assert profile.torch_ops_line(_row()) == "4x8192x16x128 causal: no torch op ran"


# ---------------------------------------------------------------------------------------------
# The cuDNN peer's parts that need no GPU


def test_gradient_scales_are_the_largest_powers_of_two_keeping_amax_within_448():
    scale_for = cudnn_fp8.GradScales.scale_for
    assert scale_for(1.0) == 256.0  # 512 would make 512 > 448
    assert scale_for(448.0) == 1.0 and scale_for(449.0) == 0.5
    assert scale_for(0.001) == 2.0 ** 18  # 0.001 * 2^18 = 262
    for amax in (3e-5, 0.07, 1.5, 900.0):
        assert cudnn_fp8.E4M3_MAX / 2 < amax * scale_for(amax) <= cudnn_fp8.E4M3_MAX
    # an amax with nothing to scale leaves the scale at 1
    assert scale_for(0.0) == scale_for(float("inf")) == scale_for(float("nan")) == 1.0
    assert cudnn_fp8.GradScales.from_amax(dp=1.0, dv=448.0) == cudnn_fp8.GradScales(
        dp=256.0, dq=1.0, dk=1.0, dv=1.0)


def test_the_graphs_see_a_batch_seqlen_heads_dim_tensor_as_batch_heads_seqlen_dim():
    # contiguous (2, 4096, 16, 128): strides (4096 * 16 * 128, 16 * 128, 128, 1)
    assert cudnn_fp8._bhsd((2, 4096, 16, 128), (8388608, 2048, 128, 1)) == (
        (2, 16, 4096, 128), (8388608, 128, 2048, 1))
    # the statistics are ptxattn's contiguous (batch, heads, seqlen) lse with a unit dim
    assert cudnn_fp8._stats_layout(2, 16, 4096) == ((2, 16, 4096, 1), (65536, 4096, 1, 1))


def test_libcudnn_is_looked_for_beside_torch_then_under_cudnn_path(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / "torch").mkdir(parents=True)
    wheel = site / "nvidia" / "cudnn" / "lib"
    other = site / "nvidia" / "cu13" / "lib"
    root = tmp_path / "cudnn-root" / "lib64"
    for folder in (wheel, other, root):
        folder.mkdir(parents=True)
        (folder / "libcudnn.so.9").write_bytes(b"")
    monkeypatch.setenv("CUDNN_PATH", str(tmp_path / "cudnn-root"))
    assert cudnn_fp8._libcudnn_candidates(str(site / "torch")) == [
        str(wheel / "libcudnn.so.9"), str(other / "libcudnn.so.9"), str(root / "libcudnn.so.9")]
    monkeypatch.delenv("CUDNN_PATH")
    (wheel / "libcudnn.so.9").unlink()
    assert cudnn_fp8._libcudnn_candidates(str(site / "torch")) == [str(other / "libcudnn.so.9")]


@pytest.fixture
def without_torch(monkeypatch):
    """torch made unimportable, and the peer's load forgotten before and after."""
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    cudnn_fp8._load_once.cache_clear()
    yield
    cudnn_fp8._load_once.cache_clear()


def test_without_torch_the_peer_says_so_and_the_profile_row_skips_it(without_torch):
    with pytest.raises(cudnn_fp8.CudnnUnavailable, match="torch is not importable"):
        cudnn_fp8.load()
    # the same reason again, from the first try
    with pytest.raises(cudnn_fp8.CudnnUnavailable, match="torch is not importable"):
        cudnn_fp8.library_line()
    call, why_not = profile.cudnn_fp8_backward_runner(None, None, None, None, None, False)
    assert call is None and why_not.startswith("cudnn-fp8: torch is not importable")
    assert issubclass(cudnn_fp8.CudnnUnsupported, cudnn_fp8.CudnnUnavailable)
