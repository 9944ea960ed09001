"""The quantized-array pytree and the MoE oracle on quantized experts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_formats
from pallas_kernels.moe import moe_experts
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray, quantize


@pytest.fixture(scope="module")
def experts():
    rng = np.random.default_rng(0)
    gate_up = rng.normal(0, 0.3, size=(4, 2 * 32, 64)).astype(np.float32)
    down = rng.normal(0, 0.3, size=(4, 64, 32)).astype(np.float32)
    return gate_up, down


def test_quantize_mxfp8_matches_the_numpy_encoder(experts):
    gate_up, _ = experts
    q = quantize(jnp.asarray(gate_up), MXFP8)
    assert q.shape == gate_up.shape and q.format == MXFP8 and q.global_scale is None
    data, scales = block_formats.mxfp8_encode(gate_up)
    np.testing.assert_array_equal(np.asarray(q.data).view(np.uint8), data.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q.scales), scales)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), block_formats.mxfp8_decode(data, scales))


def test_quantize_nvfp4_gives_each_expert_its_global_scale(experts):
    """Same encoding as numpy per expert, up to XLA:CPU's fp32 division, which is not correctly rounded:
    global scales may differ in the last ulp and flip a rare block scale or code."""
    gate_up, _ = experts
    q = quantize(jnp.asarray(gate_up), NVFP4)
    assert q.shape == gate_up.shape and q.global_scale.shape == (4, 1, 1)
    for e in range(gate_up.shape[0]):
        data, scales, global_scale = block_formats.nvfp4_encode(gate_up[e])
        assert abs(float(q.global_scale[e, 0, 0]) - float(global_scale)) <= 2 * np.spacing(global_scale)
        assert (np.asarray(q.scales[e]).view(np.uint8) == scales.view(np.uint8)).mean() > 0.98
        assert (np.asarray(q.data[e]) == data).mean() > 0.98
        want = block_formats.nvfp4_decode(data, scales, global_scale)
        np.testing.assert_allclose(np.asarray(q.dequantize())[e], want, rtol=0, atol=0.2)


@pytest.mark.parametrize("format", [MXFP8, NVFP4])
def test_quantized_array_is_a_pytree_through_jit(experts, format):
    q = quantize(jnp.asarray(experts[0]), format)
    leaves = jax.tree.leaves(q)
    assert len(leaves) == (2 if format == MXFP8 else 3)
    doubled = jax.jit(lambda a: a.dequantize(jnp.bfloat16).astype(jnp.float32) * 2)(q)
    np.testing.assert_array_equal(np.asarray(doubled), np.asarray(q.dequantize(jnp.bfloat16), np.float32) * 2)
    bits = {MXFP8: 8 + 8 / 32, NVFP4: 4 + 8 / 16}[format]
    assert q.nbytes == pytest.approx(experts[0].size * bits / 8 + (4 * 4 if format == NVFP4 else 0))


@pytest.mark.parametrize("format", [MXFP8, NVFP4])
def test_moe_on_quantized_experts_equals_moe_on_their_values(experts, format):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(9, 64)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.permutation(4)[:2] for _ in range(9)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.2, 1.0, size=(9, 2)), jnp.float32)
    gate_up, down = (quantize(jnp.asarray(w), format) for w in experts)
    got = moe_experts(x, gate_up, down, chosen, weights, gate_cap=4.0, up_cap=25.0)
    want = moe_experts(x, gate_up.dequantize(), down.dequantize(), chosen, weights, gate_cap=4.0, up_cap=25.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    dense = moe_experts(x, *(jnp.asarray(w) for w in experts), chosen, weights, gate_cap=4.0, up_cap=25.0)
    error = np.linalg.norm(np.asarray(got) - np.asarray(dense)) / np.linalg.norm(np.asarray(dense))
    assert error < {MXFP8: 0.06, NVFP4: 0.2}[format]  # the formats' quantization error


def test_unknown_format_is_rejected(experts):
    with pytest.raises(ValueError, match="unknown quantized format 'int4'"):
        quantize(jnp.asarray(experts[0]), "int4")


def test_nvfp4_row_global_scales_broadcast():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(2, 8, 32)).astype(np.float32)
    global_scale = np.array([0.01, 0.02], np.float32).repeat(4)[None, :, None].repeat(2, 0)  # [2, 8, 1]
    data, scales, _ = block_formats.nvfp4_encode(w, global_scale)
    q = QuantizedArray(jnp.asarray(data), jnp.asarray(scales), jnp.asarray(global_scale), NVFP4)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), block_formats.nvfp4_decode(data, scales, global_scale))
