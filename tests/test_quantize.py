"""The MXFP8 / NVFP4 encoders: NumPy references on the CPU, and the GPU quantizers held to them
bit for bit."""

import ml_dtypes
import numpy as np
import pytest

from ptxattn.quant import blockscaled as quant

E4M3_VALUES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
E2M1_MAGNITUDES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _awkward(rng, shape, scale=1.0):
    """Normal values plus the cases encoders get wrong: all-zero, tiny (bf16-subnormal), huge
    and outlier blocks, exact ties, negative zeros."""
    x = rng.standard_normal(shape).astype(np.float32) * scale
    flat = x.reshape(-1, shape[-1])
    flat[0, :32] = 0.0
    flat[1, :32] *= 1e-39
    flat[2, :32] *= 1e30
    flat[3, ::7] *= 300.0
    flat[4, :16] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75,
                    -2.5, -3.5, -5.0, -0.0]
    flat[5, :32] = -0.0
    return x


def _nearest_even(x, grid):
    """Round to the nearest of `grid` (sorted magnitudes), ties to the even index, saturating."""
    a = np.minimum(np.abs(x), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    pick = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(grid[pick], x)


def test_mxfp8_scale_is_the_smallest_that_does_not_saturate(rng):
    x = _awkward(rng, (4, 33, 3, 128))
    codes, scales = quant.encode_mxfp8(x)
    assert codes.shape == x.shape and scales.shape == (4, 33, 3, 4)
    amax = np.abs(x.reshape(*scales.shape, 32)).max(-1)
    scale = quant.decode_ue8m0(scales)
    normal = amax >= np.finfo(np.float32).tiny
    assert (amax[normal] / scale[normal] <= 448).all()
    assert (amax[normal] / scale[normal] > 224).all(), "a scale twice smaller would still fit"
    assert (scales[~normal] == 0).all()


def test_mxfp8_elements_round_to_nearest_even_e4m3(rng):
    x = _awkward(rng, (8, 16, 64))
    codes, scales = quant.encode_mxfp8(x)
    scaled = x.reshape(8, 16, 2, 32) / quant.decode_ue8m0(scales)[..., None]
    finite = np.unique(np.abs(E4M3_VALUES[np.isfinite(E4M3_VALUES)]))
    expected = _nearest_even(scaled, finite).reshape(x.shape)
    got = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, expected)


def test_mxfp8_round_trip_error_bound(rng):
    x = rng.standard_normal((3, 50, 2, 64)).astype(np.float32)
    codes, scales = quant.encode_mxfp8(x)
    err = np.abs(quant.decode_mxfp8(codes, scales) - x).reshape(*scales.shape, 32)
    amax = np.abs(x).reshape(*scales.shape, 32).max(-1, keepdims=True)
    # 3 mantissa bits: half an ulp of the block max is 2^-4 relative; smaller values do better.
    assert (err <= amax * 2.0 ** -4).all()


def test_mxfp8_v_layout_is_transposed_padded_and_blocked_along_keys(rng):
    v = _awkward(rng, (2, 200, 3, 64))
    vt, scales = quant.encode_mxfp8_v(v)
    assert vt.shape == (2, 3, 64, 256) and scales.shape == (2, 3, 64, 8)
    assert (vt[..., 200:] == 0).all()
    column = v[1, :, 2, 5]  # one head_dim column of one head, along the keys
    padded = np.concatenate([column, np.zeros(56, np.float32)])
    codes, col_scales = quant.encode_mxfp8(padded)
    np.testing.assert_array_equal(vt[1, 2, 5], codes)
    np.testing.assert_array_equal(scales[1, 2, 5], col_scales)
    np.testing.assert_array_equal(quant.decode_mxfp8_v(vt, scales, 200),
                                  quant.decode_mxfp8(vt, scales)[..., :200].transpose(0, 3, 1, 2))


def test_nvfp4_scales_codes_and_packing(rng):
    x = _awkward(rng, (4, 9, 2, 64), scale=3.0)
    x = np.where(np.abs(x) > 1e20, 0.0, x).astype(np.float32)  # keep the tensor amax finite
    packed, scales, g = quant.encode_nvfp4(x)
    assert packed.shape == (4, 9, 2, 32) and scales.shape == (4, 9, 2, 4)
    assert g == np.float32(np.abs(x).max()) / np.float32(2688)
    block_scale = quant.decode_ue4m3(scales) * g
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(x.shape)
    assert (codes == (packed[..., :, None] >> np.array([0, 4]) & 0xF).reshape(x.shape)).all()
    divisor = np.where(block_scale > 0, block_scale, 1)[..., None]
    scaled = np.where(block_scale[..., None] > 0, x.reshape(*scales.shape, 16) / divisor,
                      0).reshape(x.shape)
    expected = _nearest_even(scaled.astype(np.float32), E2M1_MAGNITUDES)
    got = codes.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(np.abs(got), np.abs(expected))
    err = np.abs(quant.decode_nvfp4(packed, scales, g) - x).reshape(*scales.shape, 16)
    amax = np.abs(x).reshape(*scales.shape, 16).max(-1, keepdims=True)
    assert (err <= amax / 6 * 1.07 + 1e-30).all()  # half the 4..6 step, scale rounding slack


def test_nvfp4_low_nibble_is_the_even_element():
    x = np.zeros((1, 16), np.float32)
    x[0, 0], x[0, 1] = 6.0, -1.0
    packed, scales, g = quant.encode_nvfp4(x)
    assert packed[0, 0] == 0x7 | (0xA << 4)  # 6 -> code 7, -1 -> sign 8 | code 2
    assert quant.decode_nvfp4(packed, scales, g)[0, 1] == -1.0


def test_nvfp4_zero_tensor_has_unit_tensor_scale():
    packed, scales, g = quant.encode_nvfp4(np.zeros((2, 32), np.float32))
    assert g == 1.0 and not packed.any() and not scales.any()


# ---------------------------------------------------------------------------------------------
# GPU quantizers, bit for bit


def _to_gpu(x, dtype):
    import cupy
    return cupy.asarray(x).astype(dtype)


def _rounded(x_gpu):
    return x_gpu.astype("float32").get()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gpu_mxfp8_rows_match_numpy(dtype, rng):
    x = _to_gpu(np.clip(_awkward(rng, (3, 37, 2, 128)), -6e4, 6e4), dtype)
    data, scales = quant.quantize_mxfp8(x)
    ref_data, ref_scales = quant.encode_mxfp8(_rounded(x))
    np.testing.assert_array_equal(scales.get(), ref_scales)
    np.testing.assert_array_equal(data.get(), ref_data)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seqlen", [1, 77, 256])
def test_gpu_mxfp8_v_matches_numpy(dtype, seqlen, rng):
    x = _to_gpu(np.clip(_awkward(rng, (2, max(seqlen, 8), 3, 64))[:, :seqlen], -6e4, 6e4), dtype)
    vt, scales = quant.quantize_mxfp8_v(x)
    ref_vt, ref_scales = quant.encode_mxfp8_v(_rounded(x))
    np.testing.assert_array_equal(scales.get(), ref_scales)
    np.testing.assert_array_equal(vt.get(), ref_vt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 300.0])
def test_gpu_nvfp4_matches_numpy(dtype, magnitude, rng):
    x = np.clip(_awkward(rng, (2, 41, 3, 64), scale=magnitude), -6e4, 6e4)
    x = _to_gpu(np.where(np.abs(x) > 1e20, 0, x).astype(np.float32), dtype)
    data, scales, g = quant.quantize_nvfp4(x)
    ref_data, ref_scales, ref_g = quant.encode_nvfp4(_rounded(x))
    assert g.get()[0] == ref_g
    np.testing.assert_array_equal(scales.get(), ref_scales)
    np.testing.assert_array_equal(data.get(), ref_data)


@pytest.mark.gpu
def test_gpu_quantizers_refuse_float32():
    import cupy
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        quant.quantize_mxfp8(cupy.zeros((2, 32), cupy.float32))
