"""AttentionProblem: the one check of an attention call, on array metadata (no GPU).

tests/test_api_validation.py, test_fp8.py and test_blockscaled.py cover each entry point's
long-standing rules; here are the rules every entry point shares: strides, outputs apart from
the inputs, outputs and descales on q's device, integer and boolean arrays, the LSE buffer, and
what the problem hands to dispatch.
"""

import ml_dtypes
import numpy as np
import pytest

from meta_array import MetaArray
from ptxattn.problem import AttentionProblem, byte_extent

SHAPE_Q, SHAPE_KV = (2, 16, 4, 64), (2, 16, 2, 64)
OUT_PTR = 1 << 30  # far from the inputs at 1 << 20


def _qkv(dtype="bfloat16", **overrides):
    """q, k and v at 1, 2 and 3 MiB: apart from each other and from OUT_PTR."""
    arrays = {"q": MetaArray(SHAPE_Q, dtype, ptr=1 << 20),
              "k": MetaArray(SHAPE_KV, dtype, ptr=2 << 20),
              "v": MetaArray(SHAPE_KV, dtype, ptr=3 << 20)}
    return {**arrays, **overrides}


def _16bit(out=None, lse=None, **overrides):
    return AttentionProblem.from_16bit(**_qkv(**overrides), out=out, lse=lse)


def _fp8(out=None, q_descale=1.0, **overrides):
    return AttentionProblem.from_fp8(**_qkv(ml_dtypes.float8_e4m3fn, **overrides),
                                     q_descale=q_descale, k_descale=1.0, v_descale=1.0, out=out)


def _blockscaled(out=None, q_tensor_scale=0.5):
    """NVFP4 operands of head_dim 64 (q and k rows of 32 bytes), 300 keys padded to 384."""
    operands = dict(
        q=MetaArray((2, 100, 4, 32), "uint8"), k=MetaArray((2, 300, 2, 32), "uint8"),
        v=MetaArray((2, 2, 64, 384), "uint8"), q_scale=MetaArray((2, 100, 4, 4), "uint8"),
        k_scale=MetaArray((2, 300, 2, 4), "uint8"), v_scale=MetaArray((2, 2, 64, 12), "uint8"))
    return AttentionProblem.from_blockscaled(**operands, format="nvfp4",
                                             q_tensor_scale=q_tensor_scale, k_tensor_scale=2.0,
                                             out=out)


def test_the_problem_carries_what_dispatch_and_allocation_need():
    p = _16bit(out=MetaArray(SHAPE_Q, ptr=OUT_PTR))
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.heads_q, p.heads_kv, p.head_dim) == (
        2, 16, 16, 4, 2, 64)
    assert (p.format, p.out_dtype, p.device, p.gqa_ratio) == ("bfloat16", "bfloat16", 0, 2)
    assert p.features == {"gqa"}
    assert AttentionProblem.from_16bit(**_qkv(k=MetaArray(SHAPE_Q), v=MetaArray(SHAPE_Q)),
                                       causal=True).features == {"causal"}
    assert (p.out_shape, p.lse_shape) == (SHAPE_Q, (2, 4, 16))
    assert _fp8().format == "e4m3" and _fp8().out_dtype == "bfloat16"
    p = _blockscaled()
    assert (p.format, p.head_dim, p.padded_seqlen_k, p.out_dtype) == ("nvfp4", 64, 384,
                                                                      "bfloat16")


def test_causal_must_be_a_bool():
    with pytest.raises(TypeError, match="causal must be a bool, got int"):
        AttentionProblem.from_16bit(**_qkv(), causal=1)


# ---------------------------------------------------------------------------------------------
# Strides


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
@pytest.mark.parametrize("strides", [(0, 1024, 128, 2), (-8192, 1024, 128, 2),
                                     (8192, 1024, 128, -2)], ids=["zero", "negative", "reversed"])
def test_zero_and_negative_strides_are_refused(name, strides):
    """A broadcast (zero stride) or reversed (negative stride) view would be misread."""
    shape = SHAPE_Q if name in ("q", "out") else SHAPE_KV
    bad = MetaArray(shape, strides=strides, ptr=OUT_PTR)
    arrays = {"out": bad} if name == "out" else {name: bad}
    with pytest.raises(ValueError, match=rf"{name} must have positive strides along every "
                                         rf"dimension longer than 1"):
        _16bit(**arrays)


def test_positive_strides_are_checked_for_fp8_too():
    bad = MetaArray(SHAPE_KV, ml_dtypes.float8_e4m3fn, strides=(0, 256, 64, 1))
    with pytest.raises(ValueError, match="k must have positive strides"):
        _fp8(k=bad)


def test_a_zero_stride_along_a_dimension_of_one_is_harmless():
    q = MetaArray((1, 16, 4, 64), strides=(0, 512, 128, 2))
    k = MetaArray((1, 16, 4, 64), ptr=2 << 20)
    assert AttentionProblem.from_16bit(q, k, k).batch == 1


@pytest.mark.parametrize("strides, match", [
    ((16384, 1024, 256, 4), r"out must have unit stride in head_dim"),
    ((8200, 1024, 128, 2), r"out must have a 16-byte aligned base"),
])
def test_out_must_have_the_strides_the_kernels_write(strides, match):
    with pytest.raises(ValueError, match=match):
        _16bit(out=MetaArray(SHAPE_Q, strides=strides, ptr=OUT_PTR))
    with pytest.raises(ValueError, match=match):
        _fp8(out=MetaArray(SHAPE_Q, strides=strides, ptr=OUT_PTR))


def test_blockscaled_out_must_be_c_contiguous():
    out = MetaArray((2, 100, 4, 64), strides=(100 * 4 * 256, 4 * 256, 256, 2), ptr=OUT_PTR)
    with pytest.raises(ValueError, match=r"out must be C-contiguous"):
        _blockscaled(out=out)


# ---------------------------------------------------------------------------------------------
# Outputs apart from the inputs


def test_byte_extent_follows_strides_both_ways():
    x = MetaArray((2, 3), "float16", strides=(6, 2), ptr=1000)
    assert byte_extent(x) == (1000, 1000 + 5 * 2 + 2)
    reversed_rows = MetaArray((2, 3), "float16", strides=(-6, 2), ptr=1000)
    assert byte_extent(reversed_rows) == (994, 1006)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_out_overlapping_an_input_is_refused(name):
    start, stop = byte_extent(_qkv()[name])
    with pytest.raises(ValueError, match=rf"out must not overlap {name} in memory"):
        _16bit(out=MetaArray(SHAPE_Q, ptr=start))  # in place
    with pytest.raises(ValueError, match=rf"out must not overlap {name} in memory"):
        _16bit(out=MetaArray(SHAPE_Q, ptr=stop - 16))  # sharing the input's last 16 bytes


def test_out_right_after_an_input_is_accepted():
    _, stop = byte_extent(_qkv()["q"])
    assert stop < 2 << 20
    assert _16bit(out=MetaArray(SHAPE_Q, ptr=stop)).head_dim == 64


def test_out_interleaved_with_an_input_is_refused():
    """Extents are compared, not elements: out in the odd heads of a buffer whose even heads
    are q shares no element with q, but is refused all the same."""
    q = MetaArray(SHAPE_Q, strides=(16 * 8 * 128, 8 * 128, 256, 2), ptr=1 << 20)
    out = MetaArray(SHAPE_Q, strides=q.strides, ptr=q.data.ptr + 128)
    with pytest.raises(ValueError, match="out must not overlap q"):
        _16bit(q=q, out=out)


def test_fp8_out_overlapping_a_descale_is_refused():
    descale = MetaArray((2, 4), np.float32, ptr=OUT_PTR)
    with pytest.raises(ValueError, match="out must not overlap q_descale"):
        _fp8(out=MetaArray(SHAPE_Q, ptr=OUT_PTR), q_descale=descale)


def test_blockscaled_out_overlapping_an_operand_is_refused():
    with pytest.raises(ValueError, match="out must not overlap q in memory"):
        _blockscaled(out=MetaArray((2, 100, 4, 64)))
    scale = MetaArray((1,), np.float32, ptr=OUT_PTR + 64)
    with pytest.raises(ValueError, match="out must not overlap q_tensor_scale"):
        _blockscaled(out=MetaArray((2, 100, 4, 64), ptr=OUT_PTR), q_tensor_scale=scale)


# ---------------------------------------------------------------------------------------------
# Devices


def test_outputs_and_descales_must_be_on_qs_device():
    with pytest.raises(ValueError, match=r"out must be on q's device 0, got 1"):
        _fp8(out=MetaArray(SHAPE_Q, ptr=OUT_PTR, device=1))
    with pytest.raises(ValueError, match=r"q_descale must be on q's device 0, got 1"):
        _fp8(q_descale=MetaArray((2, 4), np.float32, device=1))
    with pytest.raises(ValueError, match=r"out must be on q's device 0, got 1"):
        _blockscaled(out=MetaArray((2, 100, 4, 64), ptr=OUT_PTR, device=1))
    with pytest.raises(ValueError, match=r"q_tensor_scale must be on q's device 0, got 1"):
        _blockscaled(q_tensor_scale=MetaArray((1,), np.float32, ptr=OUT_PTR, device=1))


# ---------------------------------------------------------------------------------------------
# Integer and boolean arrays


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
@pytest.mark.parametrize("dtype", ["int16", "uint16", "bool"])
def test_integer_and_boolean_arrays_are_type_errors(name, dtype):
    shape = SHAPE_Q if name in ("q", "out") else SHAPE_KV
    bad = MetaArray(shape, dtype, ptr=OUT_PTR)
    arrays = {"out": bad} if name == "out" else {name: bad}
    kind = "boolean" if dtype == "bool" else "integer"
    with pytest.raises(TypeError, match=rf"{name} must have dtype float16 or bfloat16, got "
                                        rf"{dtype} \(an? {kind} array"):
        _16bit(**arrays)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "bool"])
def test_integer_and_boolean_arrays_are_refused_on_the_quantized_paths(dtype):
    with pytest.raises(TypeError, match=r"q must have dtype float8_e4m3fn"):
        _fp8(q=MetaArray(SHAPE_Q, dtype))
    with pytest.raises(TypeError, match=rf"out must have dtype bfloat16 or float16, got {dtype}"):
        _fp8(out=MetaArray(SHAPE_Q, dtype, ptr=OUT_PTR))
    with pytest.raises(TypeError, match=rf"out must have dtype bfloat16, got {dtype}"):
        _blockscaled(out=MetaArray((2, 100, 4, 64), dtype, ptr=OUT_PTR))


def test_non_arrays_are_type_errors():
    with pytest.raises(TypeError, match=r"k must be an array, got builtins.list"):
        _16bit(k=[[1.0]])


# ---------------------------------------------------------------------------------------------
# The LSE buffer


def test_an_lse_buffer_is_checked_like_an_output():
    lse = MetaArray((2, 4, 16), np.float32, ptr=OUT_PTR)
    assert _16bit(lse=lse).lse_shape == lse.shape
    with pytest.raises(TypeError, match="lse must have dtype float32, got bfloat16"):
        _16bit(lse=MetaArray((2, 4, 16), ptr=OUT_PTR))
    with pytest.raises(ValueError, match=r"lse must have shape \(batch, heads_q, seqlen_q\)"):
        _16bit(lse=MetaArray((2, 16, 4), np.float32, ptr=OUT_PTR))
    with pytest.raises(ValueError, match="lse must be C-contiguous"):
        _16bit(lse=MetaArray((2, 4, 16), np.float32, strides=(256, 4, 16), ptr=OUT_PTR))
    with pytest.raises(ValueError, match=r"lse must be on q's device 0, got 1"):
        _16bit(lse=MetaArray((2, 4, 16), np.float32, ptr=OUT_PTR, device=1))
    with pytest.raises(ValueError, match="lse must not overlap out"):
        _16bit(out=MetaArray(SHAPE_Q, ptr=OUT_PTR), lse=MetaArray((2, 4, 16), np.float32,
                                                                  ptr=OUT_PTR + 64))


def test_a_repeated_call_reuses_its_checked_problem_and_a_changed_one_is_checked_again():
    """The memo keys on every argument's metadata: the same layouts and addresses give the same
    problem object; a different stride, address, device or scalar is checked from scratch."""
    out = MetaArray(SHAPE_Q, ptr=OUT_PTR)
    first = _16bit(out=out)
    assert _16bit(out=MetaArray(SHAPE_Q, ptr=OUT_PTR)) is first
    assert _fp8(q_descale=0.5) is _fp8(q_descale=0.5)
    with pytest.raises(ValueError, match="out must not overlap q"):
        _16bit(out=MetaArray(SHAPE_Q, ptr=1 << 20))
    with pytest.raises(ValueError, match="positive strides"):
        _16bit(q=MetaArray(SHAPE_Q, strides=(0, 512, 128, 2)))
    with pytest.raises(ValueError, match="q_descale must be finite and positive"):
        _fp8(q_descale=-0.5)
    with pytest.raises(ValueError, match="device"):
        _16bit(out=MetaArray(SHAPE_Q, ptr=OUT_PTR, device=1))
    assert _16bit(out=out) is first
