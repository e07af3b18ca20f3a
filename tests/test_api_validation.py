"""Bad arguments are refused with a clear error before anything reaches a GPU.

The checks read only array metadata, so they run here on MetaArray stand-ins; the GPU tests
cover the same path with real arrays.
"""

import numpy as np
import pytest

import ptxattn
from meta_array import MetaArray
from ptxattn.problem import AttentionProblem


def qkv(batch=2, seqlen_q=16, seqlen_k=16, heads_q=4, heads_kv=4, dim=64):
    return (MetaArray((batch, seqlen_q, heads_q, dim)), MetaArray((batch, seqlen_k, heads_kv, dim)),
            MetaArray((batch, seqlen_k, heads_kv, dim)))


def test_valid_arguments_pass_and_default_scale():
    q, k, v = qkv(heads_q=8, heads_kv=2)
    problem = AttentionProblem.from_16bit(q, k, v)
    assert problem.softmax_scale == pytest.approx(1 / 8)
    assert (problem.format, problem.out_dtype, problem.gqa_ratio) == ("bfloat16", "bfloat16", 4)
    assert problem.out_shape == q.shape and problem.lse_shape == (2, 8, 16)
    out = MetaArray(q.shape, ptr=1 << 30)
    assert AttentionProblem.from_16bit(q, k, v, out=out, softmax_scale=0.5).softmax_scale == 0.5


def test_numpy_arrays_are_a_type_error():
    x = np.zeros((1, 4, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"q must be a CUDA array .*, got numpy.ndarray in host"):
        ptxattn.attention(x, x, x)


@pytest.mark.parametrize("case,error,match", [
    ("q_3d", ValueError, r"q must have 4 dimensions"),
    ("k_float32", TypeError, r"k must have dtype float16 or bfloat16, got float32"),
    ("mixed_dtypes", TypeError, r"q, k and v must share a dtype"),
    ("kv_shapes", ValueError, r"k and v must have the same shape"),
    ("batch", ValueError, r"k must have batch 2 like q"),
    ("head_dim", ValueError, r"head_dim 64 like q"),
    ("heads", ValueError, r"q's heads \(6\) must be a multiple of k/v's heads \(4\)"),
    ("empty", ValueError, r"v must not be empty"),
    ("strided_dim", ValueError, r"q must have unit stride in head_dim"),
    ("misaligned_stride", ValueError, r"k must have a 16-byte aligned base"),
    ("misaligned_ptr", ValueError, r"v must have a 16-byte aligned base"),
    ("devices", ValueError, r"q, k and v must be on one device"),
    ("out_shape", ValueError, r"out must have q's shape"),
    ("out_device", ValueError, r"out must be on q's device"),
    ("scale_negative", ValueError, r"softmax_scale must be a finite positive number"),
    ("scale_nan", ValueError, r"softmax_scale must be a finite positive number"),
    ("scale_string", ValueError, r"softmax_scale must be a finite positive number"),
])
def test_bad_arguments_name_the_argument(case, error, match):
    q, k, v = qkv()
    out, scale = None, None
    if case == "q_3d":
        q = MetaArray((2, 16, 64))
    elif case == "k_float32":
        k = MetaArray(k.shape, dtype="float32")
    elif case == "mixed_dtypes":
        v = MetaArray(v.shape, dtype="float16")
    elif case == "kv_shapes":
        v = MetaArray((2, 17, 4, 64))
    elif case == "batch":
        k = v = MetaArray((3, 16, 4, 64))
    elif case == "head_dim":
        k = v = MetaArray((2, 16, 4, 128))
    elif case == "heads":
        q = MetaArray((2, 16, 6, 64))
    elif case == "empty":
        v = MetaArray((2, 0, 4, 64))
    elif case == "strided_dim":
        q = MetaArray(q.shape, strides=(4096, 1024, 256, 4))
    elif case == "misaligned_stride":
        k = MetaArray(k.shape, strides=(8 * 65 * 16, 8 * 65, 130, 2))
    elif case == "misaligned_ptr":
        v = MetaArray(v.shape, ptr=(1 << 20) + 2)
    elif case == "devices":
        v = MetaArray(v.shape, device=1)
    elif case == "out_shape":
        out = MetaArray((2, 16, 4, 128))
    elif case == "out_device":
        out = MetaArray(q.shape, device=1)
    elif case.startswith("scale"):
        scale = {"scale_negative": -1.0, "scale_nan": float("nan"), "scale_string": "0.1"}[case]
    with pytest.raises(error, match=match):
        AttentionProblem.from_16bit(q, k, v, out=out, softmax_scale=scale)


def test_every_multiple_of_8_up_to_256_is_a_head_dim():
    for dim in range(8, 257, 8):
        problem = AttentionProblem.from_16bit(*qkv(dim=dim))
        assert (problem.head_dim, problem.head_dim_v) == (dim, dim)
        assert problem.softmax_scale == pytest.approx(dim ** -0.5)
        assert problem.out_shape == (2, 16, 4, dim)


def test_values_narrower_than_the_keys_give_the_output_their_head_dim():
    q, k, _ = qkv(heads_kv=2, dim=192)
    v = MetaArray((2, 16, 2, 128), ptr=3 << 20)
    problem = AttentionProblem.from_16bit(q, k, v)
    assert (problem.head_dim, problem.head_dim_v) == (192, 128)
    assert problem.softmax_scale == pytest.approx(192 ** -0.5)
    assert problem.out_shape == (2, 16, 4, 128)
    AttentionProblem.from_16bit(q, k, v, out=MetaArray((2, 16, 4, 128), ptr=4 << 20))
    with pytest.raises(ValueError, match=r"out must have .*\(2, 16, 4, 128\), got "
                                         r"\(2, 16, 4, 192\)"):
        AttentionProblem.from_16bit(q, k, v, out=MetaArray(q.shape, ptr=4 << 20))


def test_the_backward_of_narrower_values_takes_dout_and_dv_of_their_head_dim():
    q, k, _ = qkv(heads_kv=2, dim=192)
    v = MetaArray((2, 16, 2, 128), ptr=3 << 20)
    arrays = dict(dout=MetaArray((2, 16, 4, 128), ptr=4 << 20),
                  out=MetaArray((2, 16, 4, 128), ptr=5 << 20),
                  lse=MetaArray((2, 4, 16), "float32", ptr=6 << 20))

    def backward(**overrides):
        args = {**arrays, **overrides}
        return AttentionProblem.from_backward(args.pop("dout"), q, k, v, args.pop("out"),
                                              args.pop("lse"), **args)

    assert backward(dv=MetaArray(v.shape, ptr=7 << 20)).head_dim_v == 128
    for name in ("dout", "out"):
        with pytest.raises(ValueError, match=rf"{name} must have .*\(2, 16, 4, 128\), got "
                                             rf"\(2, 16, 4, 192\)"):
            backward(**{name: MetaArray(q.shape, ptr=8 << 20)})
    with pytest.raises(ValueError, match=r"dv must have the shape of v \(2, 16, 2, 128\), got "
                                         r"\(2, 16, 2, 192\)"):
        backward(dv=MetaArray(k.shape, ptr=7 << 20))
