"""FP8 (e4m3) path: carrier and argument checks, quantizers, the attention kernel, accuracy.

CPU tests check metadata validation on stand-ins, the host helpers against ml_dtypes, and that
every quantizer variant compiles without spills. GPU tests check the quantizers byte for byte
against a NumPy/ml_dtypes encoding, the kernel against FP32 attention of the dequantized inputs,
and measure the accuracy of the three quantization schemes against FP32 attention of the
original inputs.

Kernel tolerance: the rule of tests/test_attention.py, with the naive computation at the
kernel's precisions as yardstick. Against FP32 attention of the dequantized inputs, the kernel's
max error must be at most twice the larger of two naive errors: the same math with the
probabilities rounded to e4m3 (fp8.reference(precision="fp8"): what P V on e4m3 costs), and
the same math in the output's 16-bit type (reference.attention(precision="input") of the
dequantized inputs: scores and probabilities rounded to 16 bits, which also bounds what the FP8
tensor cores' reduced-precision accumulation costs), plus one rounding of the output; the LSE's
at most twice the 16-bit computation's.
"""

import math

import ml_dtypes
import numpy as np
import pytest

import meta_array
from inputs import grouped_qkv
from probe_kernels import probe_spec
from ptxattn import fp8, runtime
from ptxattn.quant import fp8 as quant_fp8
from ptxattn.problem import AttentionProblem


def MetaArray(shape, dtype=fp8.E4M3, **kwargs):
    return meta_array.MetaArray(shape, dtype, **kwargs)


def _qkv(batch=2, seqlen_q=300, seqlen_k=200, heads_q=8, heads_kv=2, dim=128, dtype=fp8.E4M3):
    return (MetaArray((batch, seqlen_q, heads_q, dim), dtype),
            MetaArray((batch, seqlen_k, heads_kv, dim), dtype),
            MetaArray((batch, seqlen_k, heads_kv, dim), dtype))


def _validate(q, k, v, q_descale=1.0, k_descale=1.0, v_descale=1.0, out=None, out_dtype=None,
              softmax_scale=None):
    """(softmax scale, output dtype) of the checked problem."""
    problem = AttentionProblem.from_fp8(q, k, v, q_descale=q_descale, k_descale=k_descale,
                                        v_descale=v_descale, out=out, out_dtype=out_dtype,
                                        softmax_scale=softmax_scale)
    return problem.softmax_scale, problem.out_dtype


# ---------------------------------------------------------------------------------------------
# CPU: carrier, descales and argument checks


def test_valid_arguments_and_every_descale_granularity():
    q, k, v = _qkv()
    assert _validate(q, k, v) == (pytest.approx(1 / math.sqrt(128)), "bfloat16")
    per_head_q, per_head_kv = MetaArray((2, 8), np.float32), MetaArray((2, 2), np.float32)
    per_block_q, per_block_k = MetaArray((2, 8, 3), np.float32), MetaArray((2, 2, 2), np.float32)
    scalar = MetaArray((), np.float32)
    for qd, kd, vd in [(scalar, scalar, scalar), (per_head_q, per_head_kv, per_head_kv),
                       (per_block_q, per_block_k, per_head_kv), (0.5, per_block_k, 2.0)]:
        assert _validate(q, k, v, qd, kd, vd, out_dtype="float16")[1] == "float16"
    out = MetaArray(q.shape, ml_dtypes.bfloat16, ptr=1 << 30)
    assert _validate(q, k, v, out=out)[1] == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_16_bit_data_where_fp8_is_expected_is_a_type_error(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"k must have dtype float8_e4m3fn .* quantize it first"):
        _validate(q, MetaArray(k.shape, np.dtype(dtype)), v)


def test_raw_bytes_must_be_viewed_as_e4m3():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"q must have dtype float8_e4m3fn .*E4M3Array\(q\)"):
        _validate(MetaArray(q.shape, np.uint8), k, v)
    with pytest.raises(TypeError, match="only e4m3"):
        _validate(q, k, MetaArray(v.shape, ml_dtypes.float8_e5m2))


def test_a_missing_descale_is_a_clear_error():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v_descale is required"):
        _validate(q, k, v, v_descale=None)
    with pytest.raises(TypeError, match="missing .* keyword-only argument.*k_descale"):
        fp8.attention(q, k, v, q_descale=1.0, v_descale=1.0)


@pytest.mark.parametrize("bad, error, message", [
    (dict(q_descale=MetaArray((2, 2), np.float32)), ValueError, r"q_descale must have one of"),
    (dict(k_descale=MetaArray((2, 8), np.float32)), ValueError, r"k_descale must have one of"),
    (dict(v_descale=MetaArray((2, 2, 2), np.float32)), ValueError, r"v_descale must have one of"),
    (dict(q_descale=MetaArray((2, 8), np.float64)), TypeError, r"q_descale must have dtype float32"),
    (dict(k_descale=0.0), ValueError, r"k_descale must be finite and positive"),
    (dict(k_descale=float("nan")), ValueError, r"k_descale must be finite and positive"),
    (dict(v_descale="1"), TypeError, r"v_descale must be a positive number or a float32"),
    (dict(q_descale=True), TypeError, r"q_descale must be a positive number or a float32"),
    (dict(k_descale=np.ones((2, 2), np.float32)), TypeError, r"k_descale must be a positive"),
])
def test_bad_descales_are_refused(bad, error, message):
    q, k, v = _qkv()
    with pytest.raises(error, match=message):
        _validate(q, k, v, **bad)


def test_shape_and_output_checks():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="head_dim must be a multiple of 16 from 16 to 256"):
        _validate(*_qkv(dim=72))
    with pytest.raises(ValueError, match="multiple of k/v's heads"):
        _validate(*_qkv(heads_q=6, heads_kv=4))
    with pytest.raises(TypeError, match="out must have dtype bfloat16 or float16"):
        _validate(q, k, v, out=MetaArray(q.shape, np.float32))
    with pytest.raises(ValueError, match="out has dtype float16 but out_dtype is bfloat16"):
        _validate(q, k, v, out=MetaArray(q.shape, np.float16), out_dtype="bfloat16")
    with pytest.raises(ValueError, match="out_dtype must be bfloat16 or float16"):
        _validate(q, k, v, out_dtype="float32")
    with pytest.raises(ValueError, match="16-byte aligned"):
        _validate(q, MetaArray(k.shape, ptr=(1 << 20) + 8), v)


def test_numpy_arrays_are_refused_before_anything_else():
    x = np.zeros((1, 4, 2, 64), fp8.E4M3)
    with pytest.raises(TypeError, match=r"q must be a CUDA array .*numpy.ndarray in host memory"):
        fp8.attention(x, x, x, q_descale=1.0, k_descale=1.0, v_descale=1.0)


def test_e4m3_table_and_rounding_match_ml_dtypes(rng):
    values = quant_fp8.e4m3_values()
    assert values[0x7e] == 448 and values[0x08] == 2.0 ** -6 and values[0x01] == 2.0 ** -9
    assert np.isnan(values[0x7f]) and np.isnan(values[0xff])
    finite = np.sort(values[np.isfinite(values)])
    midpoints = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact ties
    x = np.concatenate([rng.standard_normal(200_000).astype(np.float32) * s
                        for s in (1e-3, 0.1, 1, 30, 300)] + [midpoints, finite])
    x = np.clip(x, -fp8.E4M3_MAX, fp8.E4M3_MAX)
    np.testing.assert_array_equal(fp8.round_to_e4m3(x), x.astype(fp8.E4M3).astype(np.float32))
    assert fp8.round_to_e4m3(np.float32([1000, -1e9])).tolist() == [448, -448]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_hadamard_rotation_is_orthogonal_and_keeps_qk(head_dim, rng):
    rotation = fp8.hadamard_rotation(head_dim, seed=7)
    r = rotation.matrix()
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-12)
    assert set(np.unique(rotation.signs)) <= {-1.0, 1.0}
    assert np.array_equal(rotation.signs, fp8.hadamard_rotation(head_dim, seed=7).signs)
    q, k = rng.standard_normal((2, 5, head_dim))
    np.testing.assert_allclose((q @ r) @ (k @ r).T, q @ k.T, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# GPU: carrier and quantizers


def _random(shape, dtype, rng, scale=1.0, outliers=0.0):
    """Standard normal times `scale`; with `outliers` that fraction of entries times 10."""
    import cupy
    x = rng.standard_normal(shape, dtype=np.float32) * scale
    if outliers:
        x = np.where(rng.random(shape) < outliers, x * 10, x).astype(np.float32)
    return cupy.asarray(x).astype(dtype)


def _host_quantize(x, granularity, rotation=None):
    """NumPy/ml_dtypes encoding the GPU quantizer must reproduce: (bytes, descale)."""
    x = x.astype(np.float32)
    if rotation is not None:
        x = (x.astype(np.float64) @ rotation.matrix()).astype(np.float32)
    batch, seqlen, heads, _ = x.shape
    blocks = -(-seqlen // fp8.SCALE_BLOCK_ROWS)
    pad = np.zeros((batch, blocks * fp8.SCALE_BLOCK_ROWS - seqlen) + x.shape[2:], np.float32)
    grouped = np.abs(np.concatenate([x, pad], axis=1)).reshape(
        batch, blocks, fp8.SCALE_BLOCK_ROWS, heads, -1)
    amax = grouped.max(axis=(2, 4)).transpose(0, 2, 1)  # (batch, heads, blocks)
    amax = {"block": amax, "head": amax.max(axis=2), "tensor": amax.max()}[granularity]
    descale = np.where(amax > 0, np.float32(amax) / np.float32(448), np.float32(1))
    descale = np.asarray(descale, np.float32)
    if granularity == "block":
        rows = np.repeat(descale, fp8.SCALE_BLOCK_ROWS, axis=2)[:, :, :seqlen]
        rows = rows.transpose(0, 2, 1)[..., None]
    elif granularity == "head":
        rows = descale[:, None, :, None]
    else:
        rows = descale
    scaled = np.clip(x / rows, -448, 448)
    return scaled.astype(fp8.E4M3).view(np.uint8), descale


@pytest.mark.gpu
def test_e4m3_array_carries_fp8_and_raw_arrays_are_refused():
    import cupy
    # Why uint8 storage: CuPy 14 allocates no FP8 arrays.
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cupy.empty((2, 3), dtype=fp8.E4M3)
    host = np.float32([0.5, -3.0, 448.0, 2.0 ** -9] * 16).reshape(1, 1, 1, 64).astype(fp8.E4M3)
    x = fp8.E4M3Array.from_host(host)
    assert x.dtype == fp8.E4M3 and x.bytes.dtype == np.uint8 and x.shape == (1, 1, 1, 64)
    assert x.get().dtype == fp8.E4M3
    np.testing.assert_array_equal(x.get().astype(np.float32), host.astype(np.float32))
    assert x[..., 1:].shape == (1, 1, 1, 63) and x[..., 1:].get()[0, 0, 0, 0] == -3
    assert quant_fp8.as_e4m3("q", x.bytes.view(fp8.E4M3)).bytes.data.ptr == x.bytes.data.ptr
    q = cupy.zeros((1, 16, 2, 64), cupy.uint8)
    with pytest.raises(TypeError, match=r"q must have dtype float8_e4m3fn .*E4M3Array\(q\)"):
        fp8.attention(q, q, q, q_descale=1.0, k_descale=1.0, v_descale=1.0)
    with pytest.raises(TypeError, match=r"k must have dtype float8_e4m3fn \(FP8 e4m3\), got bfloat16"):
        fp8.attention(fp8.E4M3Array(q), q.astype("bfloat16"), fp8.E4M3Array(q),
                      q_descale=1.0, k_descale=1.0, v_descale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
def test_quantizer_matches_host_encoding_byte_for_byte(dtype, head_dim, granularity, rng):
    import cupy
    packed = _random((2, 300, 3, 2, head_dim), dtype, rng, scale=3.0, outliers=1e-3)
    x = packed[:, :, :, 1]  # strided view
    packed[0, :, 1] = 0  # an all-zero head: descale 1
    x8, descale = fp8.quantize(x, granularity)
    assert x8.dtype == fp8.E4M3 and x8.shape == x.shape and x8.bytes.flags.c_contiguous
    expected_bytes, expected_descale = _host_quantize(cupy.asnumpy(x.astype(cupy.float32)),
                                                      granularity)
    np.testing.assert_array_equal(descale.get(), expected_descale)
    np.testing.assert_array_equal(x8.bytes.get(), expected_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotating_quantizer_matches_host_rotation(head_dim, rng):
    import cupy
    x = _random((1, 257, 2, head_dim), "bfloat16", rng, outliers=1e-3)
    rotation = fp8.hadamard_rotation(head_dim, seed=3)
    x8, descale = fp8.quantize(x, "block", rotation)
    host = cupy.asnumpy(x.astype(cupy.float32))
    expected_bytes, expected_descale = _host_quantize(host, "block", rotation)
    np.testing.assert_allclose(descale.get(), expected_descale, rtol=1e-6)
    # FP32 butterflies and the float64 matrix product may straddle an e4m3 rounding boundary:
    # allow one step there, rarely. Steps are counted on the ordinal of the code (sign-magnitude
    # bytes to signed integers), so +0 (0x00) and -0 (0x80), which a rotated value that cancels
    # to zero may round to either way, are the same.
    def ordinal(codes):
        codes = codes.astype(np.int16)
        return np.where(codes >= 128, 128 - codes, codes)

    step = np.abs(ordinal(x8.bytes.get()) - ordinal(expected_bytes))
    assert step.max() <= 1 and (step > 0).mean() < 1e-3
    rotated = host.astype(np.float64) @ rotation.matrix()
    np.testing.assert_allclose(fp8.dequantize(x8, descale).get(), rotated,
                               atol=float(descale.max()) * 2 ** -9 + 1e-6,
                               rtol=2 ** -4)


# ---------------------------------------------------------------------------------------------
# GPU: the FP8 wgmma building blocks (tests/probes/fp8_wgmma_probe.cu)


def _probe_spec(head_dim):
    return probe_spec(f"fp8_wgmma_probe_d{head_dim}", "fp8_wgmma_probe.cu", "fp8_wgmma_probe",
                      ("sm_90a",), defines={"HEAD_DIM": head_dim},
                      smem_bytes=64 * head_dim + 3 * 128 * head_dim + 1024)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_probe_compiles_without_spills(head_dim):
    compiled = runtime.compile(_probe_spec(head_dim), "sm_90a")
    if compiled.report is None:
        pytest.skip("this NVRTC does not report ptxas numbers")
    assert compiled.spill_bytes == 0


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_wgmma_transpose_and_permuted_p(head_dim, rng):
    """S = Q K^T by SS wgmma, V transposed in shared memory, O = e4m3(S) V by RS wgmma."""
    import cupy
    from ptxattn.runtime import device_arch
    if device_arch() != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    q, k, v = (rng.standard_normal((rows, head_dim), dtype=np.float32).astype(fp8.E4M3)
               for rows in (64, 128, 128))
    s = cupy.zeros((64, 128), cupy.float32)
    o = cupy.zeros((64, head_dim), cupy.float32)
    spec = _probe_spec(head_dim)
    runtime.launch(runtime.load(spec), (1, 1, 1), (128, 1, 1),
                   [cupy.asarray(x.view(np.uint8)) for x in (q, k, v)] + [s, o])
    qf, kf, vf = (x.astype(np.float64) for x in (q, k, v))
    s_host = s.get()
    np.testing.assert_allclose(s_host, qf @ kf.T, rtol=1e-3, atol=1e-3 * np.abs(qf @ kf.T).max())
    # |S| stays far below 448 here, so e4m3(S) is the kernel-side rounding of these values.
    expected = fp8.round_to_e4m3(s_host).astype(np.float64) @ vf
    np.testing.assert_allclose(o.get(), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


# ---------------------------------------------------------------------------------------------
# GPU: the attention kernel


def _quantized(shape_q, shape_kv, rng, granularity="head", out_scale=1.0):
    q = _random(shape_q, "bfloat16", rng, out_scale)
    k = _random(shape_kv, "bfloat16", rng, out_scale)
    v = _random(shape_kv, "bfloat16", rng)
    return fp8.quantize_qkv(q, k, v, granularity)


def errors(q8, k8, v8, descales, out, lse, *, causal, softmax_scale=None) -> dict:
    """The kernel's errors against FP32 attention of the dequantized inputs, and the bounds the
    module docstring derives from the naive computations."""
    import cupy
    from ptxattn import reference
    ref, ref_lse = fp8.reference(q8, k8, v8, **descales, causal=causal,
                                 softmax_scale=softmax_scale, return_lse=True)
    naive_fp8 = fp8.reference(q8, k8, v8, **descales, causal=causal, softmax_scale=softmax_scale,
                              precision="fp8")
    low = [fp8.dequantize(x, descales[f"{n}_descale"]).astype(out.dtype)
           for x, n in ((q8, "q"), (k8, "k"), (v8, "v"))]
    naive_16, naive_16_lse = reference.attention(*low, causal=causal, softmax_scale=softmax_scale,
                                                 return_lse=True, precision="input")
    visible = cupy.isfinite(ref_lse)
    noise = float(cupy.abs((ref + 0.3 - 0.3).astype(out.dtype).astype(cupy.float32) - ref).max())
    naive_err = max(float(cupy.abs(naive_fp8 - ref).max()), float(cupy.abs(naive_16 - ref).max()))
    naive_lse_err = float(cupy.abs(cupy.where(visible, naive_16_lse - ref_lse, 0)).max())
    return {
        "finite": bool(cupy.isfinite(out).all()),
        "lse_pattern": bool((cupy.isfinite(lse) == visible).all()),
        "err": float(cupy.nan_to_num(cupy.abs(out.astype(cupy.float32) - ref), nan=1e9).max()),
        "err_bound": 2 * naive_err + 2 * noise + 1e-6,
        "lse_err": float(cupy.nan_to_num(cupy.abs(cupy.where(visible, lse - ref_lse, 0)),
                                         nan=1e9).max()),
        "lse_bound": 2 * naive_lse_err + 1e-4,
    }


def _assert_close(q8, k8, v8, descales, out, lse, *, causal, softmax_scale=None):
    e = errors(q8, k8, v8, descales, out, lse, causal=causal, softmax_scale=softmax_scale)
    assert e["finite"], "output has NaN/Inf (or was not written)"
    assert e["lse_pattern"], "LSE -inf pattern differs"
    assert e["err"] <= e["err_bound"], e
    assert e["lse_err"] <= e["lse_bound"], e


SEQLEN_PAIRS = [(1, 1), (17, 17), (127, 127), (1000, 1000), (4097, 4097), (17, 1000), (1000, 17),
                (127, 4097)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", SEQLEN_PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_kernel_matches_fp32_on_dequantized_inputs(causal, head_dim, seqlens, rng):
    import cupy
    seqlen_q, seqlen_k = seqlens
    batch = 2 if seqlen_q * seqlen_k < 10 ** 6 else 1
    q8, k8, v8, descales = _quantized((batch, seqlen_q, 2, head_dim),
                                      (batch, seqlen_k, 2, head_dim), rng)
    out = cupy.full(q8.shape, cupy.nan, dtype="bfloat16")
    _, lse = fp8.attention(q8, k8, v8, **descales, causal=causal, return_lse=True, out=out)
    _assert_close(q8, k8, v8, descales, out, lse, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("granularity", fp8.GRANULARITIES)
@pytest.mark.parametrize("heads", [(8, 2), (6, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_descale_granularities_with_grouped_heads(granularity, heads, causal, head_dim, rng):
    """Large logits (inputs x4); per-block k descales run on their own tiles (hopper.py)."""
    heads_q, heads_kv = heads
    q8, k8, v8, descales = _quantized((3, 300, heads_q, head_dim), (3, 457, heads_kv, head_dim),
                                      rng, granularity, out_scale=4.0)
    out, lse = fp8.attention(q8, k8, v8, **descales, causal=causal, return_lse=True,
                             out_dtype="float16")
    assert out.dtype == np.float16
    _assert_close(q8, k8, v8, descales, out, lse, causal=causal)


@pytest.mark.gpu
def test_scalar_descales_strided_inputs_and_output(rng):
    import cupy
    packed = fp8.E4M3Array.from_host(
        rng.standard_normal((2, 333, 3, 4, 64), dtype=np.float32).astype(fp8.E4M3))
    q8, k8, v8 = packed[:, :, 0], packed[:, :, 1], packed[:, :, 2]
    descales = {"q_descale": 0.5, "k_descale": cupy.asarray([1.5], dtype=cupy.float32),
                "v_descale": 2.0}
    big_out = cupy.full((2, 333, 8, 64), cupy.nan, dtype="bfloat16")
    out = big_out[:, :, 1::2]
    _, lse = fp8.attention(q8, k8, v8, **descales, causal=True, return_lse=True, out=out,
                           softmax_scale=0.3)
    _assert_close(q8, k8, v8, descales, out, lse, causal=True, softmax_scale=0.3)
    assert bool(cupy.isnan(big_out[:, :, 0::2]).all()), "wrote outside the out view"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rows_dominated_by_a_key_seen_after_the_max(head_dim):
    """Each row's largest score comes in a key block visited after the one that set its running
    max, ahead of it by 3 to 6 in log2 units, a different fraction per row. A kernel that keeps
    the stale max there rounds the dominant probability 2^d to e4m3 (up to 6%) while its row sum
    takes the unrounded value: such rows come out several times the naive FP8 error off (errors
    of 0.16-0.18 here on the stale-max kernel, 0.008 with the exact max)."""
    import cupy
    import numpy as np
    seqlen_q, seqlen_k = 64, 512
    scale_log2 = head_dim ** -0.5 * np.log2(np.e)
    q = np.zeros((1, seqlen_q, 1, head_dim), np.float32)
    k = np.zeros((1, seqlen_k, 1, head_dim), np.float32)
    q[0, :, 0, 0] = 1.0
    q[0, :, 0, 1] = 0.5 + 0.5 * np.arange(seqlen_q) / seqlen_q
    # Key blocks go from the last to the first. Every key scores -20 (log2 units) but key 300,
    # at 2, which moves the max, and key 50, 3 to 6 (row dependent) above it, under the 2^8 a
    # stale max tolerates. Key 50 dominates every row, so the naive errors (in the weight of
    # key 300) stay small; the scores stay small enough for bf16 to carry them well.
    k[0, :, 0, 0] = -20 / scale_log2
    k[0, 300, 0, 0] = 2 / scale_log2
    k[0, 50, 0, 0] = 2 / scale_log2
    k[0, 50, 0, 1] = 6 / scale_log2
    v = np.random.default_rng(0).standard_normal((1, seqlen_k, 1, head_dim)).astype(np.float32)
    q8, k8, v8, descales = fp8.quantize_qkv(
        *(cupy.asarray(x).astype("bfloat16") for x in (q, k, v)), granularity="head")
    out = cupy.full(q8.shape, cupy.nan, dtype="bfloat16")
    _, lse = fp8.attention(q8, k8, v8, **descales, return_lse=True, out=out)
    _assert_close(q8, k8, v8, descales, out, lse, causal=False)


def _same_bits_either_way(q, k, v, *, causal, head_dim, option, **overrides):
    """FP8 attention of bf16 q, k, v quantized with head scales, run by hopper_forward.run with
    the override `option` off and on: the outputs and LSEs must agree bit for bit, and meet the
    FP8 bounds."""
    import cupy
    from ptxattn.launchers import hopper_forward
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, "head")
    operands = tuple(quant_fp8.descale_operand(descales[f"{n}_descale"], q.shape[0], heads,
                                               seqlen)
                     for n, heads, seqlen in (("q", q.shape[2], seqlen_q),
                                              ("k", k.shape[2], seqlen_k),
                                              ("v", k.shape[2], seqlen_k)))
    results = []
    for on in (False, True):
        out = cupy.full(q8.shape, cupy.nan, dtype="bfloat16")
        lse = cupy.full((q.shape[0], q.shape[2], seqlen_q), cupy.nan, dtype=cupy.float32)
        hopper_forward.run(q8.bytes, k8.bytes, v8.bytes, out, lse, descales=operands,
                           causal=causal, softmax_scale=head_dim ** -0.5, **{option: on},
                           **overrides)
        results.append((out, lse))
    (off_out, off_lse), (on_out, on_lse) = results
    assert bool(cupy.array_equal(on_out, off_out)), f"{option} changes the output"
    assert bool(cupy.array_equal(on_lse, off_lse)), f"{option} changes the LSE"
    _assert_close(q8, k8, v8, descales, on_out, on_lse, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, tiles, consumers",
                         [(64, (128, 3), 3), (128, (192, 2), 2), (256, (64, 3), 2)])
@pytest.mark.parametrize("seqlens", [(17, 17), (300, 457), (1000, 1000)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("keys", ["normal", "growing"])
def test_stale_max_fast_path_matches_the_max_pass(causal, head_dim, tiles, consumers, seqlens,
                                                  keys, rng):
    """The softmax's fast path (row maxima kept while no probability exceeds the softmax's
    tolerance: 1 in FP8 builds, which keep the exact max) and its slow path (Q K^T again, then the
    max pass) give bitwise the results of the max pass alone."""
    q, k, v = grouped_qkv(*seqlens, head_dim, keys, rng)
    _same_bits_either_way(q, k, v, causal=causal, head_dim=head_dim, option="stale_max_first",
                          tiles=tiles, consumers=consumers)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("seqlens", [(17, 17), (300, 457), (1000, 1000)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
def test_q_in_registers_matches_q_in_shared_memory(causal, head_dim, seqlens, rng):
    """Q K^T with Q's A fragments loaded into registers (ldmatrix from the swizzled Q tile; FP8
    head_dim 128 is scheduled so) gives bitwise what the wgmma reading Q from shared memory
    gives, over 128-byte Q rows and 64-byte ones (head_dim 64, not scheduled so)."""
    q, k, v = grouped_qkv(*seqlens, head_dim, "normal", rng)
    _same_bits_either_way(q, k, v, causal=causal, head_dim=head_dim, option="q_in_registers")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("seqlens", [(17, 17), (300, 457), (1000, 1000)],
                         ids=lambda p: f"{p[0]}x{p[1]}")
def test_blocks_in_turn_match_the_intra_warpgroup_overlap(causal, head_dim, seqlens, rng):
    """Each key block's Q K^T, softmax and P V in turn (a schedule the tuner may pick) gives
    bitwise what the overlapped mainloop gives: O takes the same rescales and the same adds in
    the same order."""
    q, k, v = grouped_qkv(*seqlens, head_dim, "growing", rng)
    _same_bits_either_way(q, k, v, causal=causal, head_dim=head_dim, option="intra_overlap")


@pytest.mark.gpu
def test_causal_rows_that_see_no_key(rng):
    import cupy
    q8, k8, v8, descales = _quantized((1, 200, 2, 64), (1, 50, 2, 64), rng)
    out, lse = fp8.attention(q8, k8, v8, **descales, causal=True, return_lse=True)
    assert bool((out[:, :150] == 0).all())
    assert bool(cupy.isneginf(lse[:, :, :150]).all())
    _assert_close(q8, k8, v8, descales, out, lse, causal=True)


# ---------------------------------------------------------------------------------------------
# GPU: accuracy of the quantization schemes (docs/guide/fp8.md's table comes from this test)

SCHEMES = {"per-tensor": ("tensor", False), "per-block": ("block", False),
           "per-block + Hadamard": ("block", True)}


def measure_accuracy(outliers: float, seed: int = 0, shape=(1, 2048, 4, 128)) -> dict:
    """RMSE of each scheme's FP8 attention output, and of the bf16 kernel, against FP32
    attention of the same bf16 inputs (standard normal; `outliers` of the entries of q, k and
    v times 10)."""
    import cupy
    import ptxattn
    from ptxattn import reference
    rng = np.random.default_rng(seed)
    q, k, v = (_random(shape, "bfloat16", rng, outliers=outliers) for _ in range(3))
    ref = reference.attention(q, k, v)
    rmse = {}
    for name, (granularity, rotate) in SCHEMES.items():
        q8, k8, v8, descales = fp8.quantize_qkv(q, k, v, granularity, rotate=rotate, seed=seed)
        out = fp8.attention(q8, k8, v8, **descales)
        rmse[name] = float(cupy.sqrt(cupy.mean((out.astype(cupy.float32) - ref) ** 2)))
    out = ptxattn.attention(q, k, v)
    rmse["bf16 kernel"] = float(cupy.sqrt(cupy.mean((out.astype(cupy.float32) - ref) ** 2)))
    return rmse


@pytest.mark.gpu
def test_block_quantization_with_rotation_is_most_accurate_on_outliers():
    normal = measure_accuracy(0.0)
    outlier = measure_accuracy(1e-3)
    print("\nRMSE vs FP32     " + "  ".join(f"{n:>20}" for n in normal))
    for label, row in (("standard normal", normal), ("0.1% outliers x10", outlier)):
        print(f"{label:17}" + "  ".join(f"{row[n]:20.2e}" for n in row))
    fp8_rmse = [normal[n] for n in SCHEMES]
    # On well-behaved inputs the schemes agree (rotation costs nothing) ...
    assert max(fp8_rmse) <= 1.1 * min(fp8_rmse), normal
    # ... and every FP8 scheme stays within a small multiple of the bf16 kernel's error.
    assert max(fp8_rmse) <= 30 * normal["bf16 kernel"], normal
    # With outliers, block scales + rotation is strictly the most accurate, by a clear margin.
    best = outlier["per-block + Hadamard"]
    assert best < 0.8 * outlier["per-block"], outlier
    assert best < 0.8 * outlier["per-tensor"], outlier
    assert outlier["per-block"] < outlier["per-tensor"], outlier
