"""ptxattn/params.py mirrors ptx_src/roles/params.cuh: NVRTC checks every field's offset and the size
(no GPU needed), so a field added, moved or retyped on one side alone fails here."""

import ctypes

import pytest

from ptxattn import params, runtime


def _needs_builtin_offsetof():
    if runtime.nvrtc_version() < (13, 5):
        pytest.skip("NVRTC 13.0 rejects __builtin_offsetof in a constant expression; the layout "
                    "is checked where CI runs, with NVRTC 13.5")


def test_fwd_params_layout_matches_the_device_struct():
    _needs_builtin_offsetof()
    runtime.check_source(params.layout_check_source(), "params_layout_check.cu", "sm_80")


@pytest.mark.parametrize("struct", ["BwdParams", "CombineParams"])
def test_other_params_layouts_match_the_device_structs(struct):
    _needs_builtin_offsetof()
    runtime.check_source(params.layout_check_source(struct), f"{struct}_layout_check.cu", "sm_80")


def test_the_layout_check_fails_on_a_drifted_field(monkeypatch):
    _needs_builtin_offsetof()
    moved = [(n, t) for n, t in params._FIELDS if n != "seqlen_q"]
    moved.insert(moved.index(("seqlen_k", ctypes.c_int32)) + 1, ("seqlen_q", ctypes.c_int32))
    monkeypatch.setattr(params, "_FIELDS", moved)

    class Drifted(ctypes.Structure):
        _fields_ = moved

    monkeypatch.setattr(params, "FwdParams", Drifted)
    with pytest.raises(runtime.CompileError, match="seqlen_q is not at offset"):
        runtime.check_source(params.layout_check_source(), "params_layout_check.cu", "sm_80")


def test_fwd_params_takes_addresses_and_refuses_unknown_fields():
    class Array:  # what FwdParams reads of a CuPy array
        class data:
            ptr = 0x1000

    p = params.FwdParams(q=Array(), seqlen_q=7, scale_log2=0.5)
    assert (p.q, p.seqlen_q, p.scale_log2, p.window_left, p.window_right) == (0x1000, 7, 0.5,
                                                                              -1, -1)
    assert ctypes.sizeof(p) % 64 == 0
    with pytest.raises(AttributeError, match="no field 'seqlen'"):
        params.FwdParams(seqlen=1)
