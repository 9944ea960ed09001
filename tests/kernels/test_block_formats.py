"""MXFP8 / NVFP4 encode and decode against ml_dtypes and the formats' scale rules, numpy and jnp."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.block_formats import (
    E2M1_VALUES,
    QuantFormatError,
    e8m0_value,
    mxfp8_decode,
    mxfp8_encode,
    nvfp4_decode,
    nvfp4_encode,
    nvfp4_unpack,
)

E4M3_CODES = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
TINY = np.finfo(np.float32).tiny


def assert_equal_up_to_flushed_subnormals(got, want64):
    """got equals want (float64) rounded to float32, except that float32-subnormal results may be
    flushed to zero (XLA and accelerators run with flush-to-zero)."""
    want = want64.astype(np.float32)
    subnormal = np.abs(want64) < TINY
    np.testing.assert_array_equal(np.where(subnormal, 0, got), np.where(subnormal, 0, want))
    assert np.all((got[subnormal] == 0) | (got[subnormal] == want[subnormal]))


FINITE_E4M3 = E4M3_CODES[np.isfinite(E4M3_CODES.astype(np.float32))]


def test_e8m0_values_match_ml_dtypes_for_every_byte():
    scale_bytes = np.arange(256, dtype=np.uint8)
    want = scale_bytes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = e8m0_value(scale_bytes)
    np.testing.assert_array_equal(got, want)  # 255 -> NaN on both sides
    np.testing.assert_array_equal(np.asarray(e8m0_value(jnp.asarray(scale_bytes))), want)


@pytest.mark.parametrize("scale_byte", [0, 1, 100, 127, 130, 254])
def test_mxfp8_decode_every_element_code(scale_byte):
    elements = np.resize(FINITE_E4M3, 32 * 8).reshape(8, 32)
    scales = np.full((8, 1), scale_byte, np.uint8)
    want = elements.astype(np.float64) * 2.0 ** (scale_byte - 127)
    with np.errstate(over="ignore"):
        assert_equal_up_to_flushed_subnormals(mxfp8_decode(elements, scales), want)
        got_jnp = np.asarray(mxfp8_decode(jnp.asarray(elements), jnp.asarray(scales)))
        assert_equal_up_to_flushed_subnormals(got_jnp, want)


def test_nvfp4_unpack_every_byte_low_nibble_first():
    packed = np.arange(256, dtype=np.uint8)[None]
    values = nvfp4_unpack(packed).reshape(256, 2)
    codes = np.arange(256, dtype=np.uint8)
    np.testing.assert_array_equal(values[:, 0], (codes & 0xF).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    np.testing.assert_array_equal(values[:, 1], (codes >> 4).view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    assert np.signbit(values[8, 0]) and values[8, 0] == 0  # code 8 is negative zero


def test_nvfp4_decode_every_scale_code():
    rng = np.random.default_rng(0)
    scales = FINITE_E4M3[np.abs(FINITE_E4M3.astype(np.float32)) >= 0]  # negative scales decode too
    packed = rng.integers(0, 256, size=(len(scales), 8), dtype=np.uint8)
    global_scale = np.float32(0.37)
    got = nvfp4_decode(packed, scales[:, None], global_scale)
    values = nvfp4_unpack(packed).astype(np.float64)
    want = (values * scales.astype(np.float64)[:, None] * np.float64(global_scale)).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)
    got_jnp = nvfp4_decode(jnp.asarray(packed), jnp.asarray(scales[:, None]), jnp.asarray(global_scale))
    np.testing.assert_array_equal(np.asarray(got_jnp), got)


def _random_blocks(rng, rows, width):
    magnitudes = 2.0 ** rng.uniform(-20, 20, size=(rows, 1))
    return (rng.normal(size=(rows, width)) * magnitudes).astype(np.float32)


def test_mxfp8_encode_follows_the_ocp_floor_rule():
    rng = np.random.default_rng(1)
    x = _random_blocks(rng, 64, 32)
    elements, scales = mxfp8_encode(x)
    for row in range(64):
        amax = float(np.abs(x[row]).max())
        exponent = math.floor(math.log2(amax)) - 8
        assert scales[row, 0] == exponent + 127
        want = np.clip(x[row].astype(np.float64) / 2.0**exponent, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(elements[row].view(np.uint8), want.view(np.uint8))
    jnp_elements, jnp_scales = mxfp8_encode(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(jnp_elements).view(np.uint8), elements.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(jnp_scales), scales)


@pytest.mark.parametrize("amax", [448.0, 463.9, 464.0, 486.0, 511.99, 2.0**127 * 1.9, 3e38])
def test_mxfp8_block_max_at_or_above_the_element_limit_saturates(amax):
    x = np.linspace(-1, 1, 32).astype(np.float32) * np.float32(amax)
    elements, scales = mxfp8_encode(x[None])
    decoded = mxfp8_decode(elements, scales)
    assert np.isfinite(decoded).all()
    assert np.abs(decoded - x).max() <= np.abs(x).max() * 2**-3


def test_mxfp8_subnormals_zero_and_negative_zero():
    x = np.zeros((3, 32), np.float32)
    x[1] = np.float32(1e-40) * np.arange(32)  # f32 subnormals
    x[2, 0] = -0.0
    elements, scales = mxfp8_encode(x)
    assert scales[0, 0] == 0 and scales[2, 0] == 0  # all-zero blocks take the smallest scale
    decoded = mxfp8_decode(elements, scales)
    np.testing.assert_array_equal(decoded[0], 0)
    assert np.signbit(decoded[2, 0])
    np.testing.assert_allclose(decoded[1], x[1], rtol=2**-3, atol=0)


def test_nvfp4_encode_follows_the_recipe():
    rng = np.random.default_rng(2)
    x = _random_blocks(rng, 32, 64) * np.float32(1e-10)
    packed, scales, global_scale = nvfp4_encode(x)
    assert global_scale == np.float32(np.abs(x).max() / np.float32(2688.0))
    for row in range(32):
        for block in range(4):
            values = x[row, 16 * block : 16 * (block + 1)].astype(np.float64)
            scale = np.clip(np.abs(values).max() / (6 * np.float64(global_scale)), 2**-9, 448)
            scale = np.float32(scale).astype(ml_dtypes.float8_e4m3fn)
            assert scales[row, block].view(np.uint8) == scale.view(np.uint8)
            step = np.float64(scale.astype(np.float32)) * np.float64(global_scale)
            want = np.clip(values / step, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
            got = nvfp4_unpack(packed[row, 8 * block : 8 * (block + 1)])
            np.testing.assert_array_equal(got, want)
    # jnp: XLA:CPU's fp32 division is not correctly rounded, so scales may differ in the last ulp
    jnp_packed, jnp_scales, jnp_global = (np.asarray(a) for a in nvfp4_encode(jnp.asarray(x)))
    assert abs(float(jnp_global) - float(global_scale)) <= 2 * np.spacing(global_scale)
    assert (jnp_scales.view(np.uint8) == scales.view(np.uint8)).mean() > 0.98
    assert (jnp_packed == packed).mean() > 0.98


def test_nvfp4_rounds_ties_to_even_and_saturates():
    # global 1 and block amax 6 give block scale 1: the codes see the values themselves
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.75, -5.0, 6.0, 0, 0, 0, 0, -6.0], np.float32)
    packed, scales, _ = nvfp4_encode(ties[None], global_scale=1.0)
    assert scales[0, 0] == 1.0
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -4.0, 6.0, 0, 0, 0, 0, -6.0]
    np.testing.assert_array_equal(nvfp4_unpack(packed)[0], want)
    saturated, _, _ = nvfp4_encode(np.full((1, 16), 100.0, np.float32), global_scale=1.0)
    # the block scale 100 / 6 rounds to 16 in E4M3, so 100 / 16 = 6.25 saturates at code 6
    np.testing.assert_array_equal(nvfp4_unpack(saturated)[0], 6.0)


def test_nvfp4_zero_blocks_and_negative_zero():
    x = np.zeros((2, 16), np.float32)
    x[1, 3] = -0.0
    packed, scales, global_scale = nvfp4_encode(x)
    assert global_scale == 1.0 and (scales.astype(np.float32) == 1.0).all()
    decoded = nvfp4_decode(packed, scales, global_scale)
    np.testing.assert_array_equal(decoded, 0)
    assert np.signbit(decoded[1, 3])


def test_e2m1_table_is_the_format():
    np.testing.assert_array_equal(E2M1_VALUES[:8], [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    np.testing.assert_array_equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("encode", [mxfp8_encode, nvfp4_encode])
def test_non_finite_inputs_are_rejected(encode, bad):
    x = np.ones((2, 32), np.float32)
    x[1, 5] = bad
    with pytest.raises(QuantFormatError, match="NaN or inf"):
        encode(x)
    with pytest.raises(QuantFormatError, match="NaN or inf"):
        encode(jnp.asarray(x))


@pytest.mark.parametrize(("encode", "width"), [(mxfp8_encode, 48), (nvfp4_encode, 24)])
def test_width_must_be_whole_blocks(encode, width):
    with pytest.raises(QuantFormatError, match="multiple of the block size"):
        encode(np.ones((2, width), np.float32))
