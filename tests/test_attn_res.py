"""The fused attention-residual mix + RMSNorm: the oracle is the model's own computation (the mix module, then
the sublayer's RMSNorm, then the rounding to the activation dtype), and the Mosaic TPU kernel matches the oracle
in Pallas' TPU interpret mode with race detection (sources of mixed scales and dtypes, 1 or 3 queries, token
counts that leave a partial tile) and lowers for TPU v7x at the production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax._src.pallas.mosaic.interpret import interpret_pallas_call
from jax.experimental.pallas import tpu as pltpu

from inkling_jax.model.attn_res import BlockAttentionResidual
from inkling_jax.model.norms import RMSNorm
from pallas_kernels.attn_res import attn_res_norm, reference, tpu
from pallas_kernels.numerics import round_to

EPS = 1e-5


def case(seed: int, count: int, queries: int, shape: tuple[int, ...], partial_dtype: jnp.dtype) -> dict:
    """Random sources whose scales differ by orders of magnitude (block sums grow with depth), a partial
    in `partial_dtype`, random queries and norm gains."""
    keys = jax.random.split(jax.random.key(seed), count + 4)
    hidden = shape[-1]
    scales = jnp.exp(jax.random.uniform(keys[0], (count + 1,), minval=-2.0, maxval=4.0))
    sources = [
        (jax.random.normal(keys[i + 1], shape) * scales[i]).astype(jnp.bfloat16) for i in range(count)
    ]  # fmt: skip
    partial = (jax.random.normal(keys[count + 1], shape) * scales[count]).astype(partial_dtype)
    return {
        "sources": sources, "partial": partial,
        "queries": jax.random.normal(keys[count + 2], (queries, hidden)) * 0.5,
        "norm_weights": (1 + 0.2 * jax.random.normal(keys[count + 3], (queries, hidden))).astype(jnp.bfloat16),
    }  # fmt: skip


@pytest.mark.parametrize(("count", "queries"), [(0, 1), (3, 3), (8, 1)])
def test_reference_is_the_models_mix_then_norm(count, queries):
    x = case(count, count, queries, (2, 5, 64), jnp.float32)
    mix = BlockAttentionResidual(nnx.Rngs(0), 64, queries)
    mix.query[...] = x["queries"].reshape(mix.query[...].shape)
    norms = [RMSNorm(nnx.Rngs(0), 64, EPS, jnp.bfloat16) for _ in range(queries)]
    for norm, weight in zip(norms, x["norm_weights"], strict=True):
        norm.weight[...] = weight
    mixes = mix(x["sources"], x["partial"])
    want = jnp.stack([round_to(norm(h), jnp.bfloat16) for norm, h in zip(norms, mixes, strict=True)])
    got = reference.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def interpreted(**inputs) -> jax.Array:
    """The TPU kernel's output in interpret mode, failing on any race between its DMAs and compute."""
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait", uninitialized_memory="nan")
    try:
        with pltpu.force_tpu_interpret_mode(params):
            out = jax.block_until_ready(tpu.attn_res_norm(**inputs, eps=EPS, out_dtype=jnp.bfloat16))
    finally:
        races = interpret_pallas_call.races
        pltpu.reset_tpu_interpret_mode_state()
    assert races is not None and not races.races_found
    return out


@pytest.mark.parametrize(
    ("count", "queries", "shape", "partial_dtype"),
    [(0, 1, (3, 256), jnp.bfloat16), (3, 3, (2, 13, 256), jnp.float32), (8, 1, (37, 256), jnp.float32)],
)
def test_tpu_kernel_matches_the_reference(count, queries, shape, partial_dtype):
    x = case(10 + count, count, queries, shape, partial_dtype)
    got = np.asarray(interpreted(**x), np.float32)
    want = np.asarray(reference.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16), np.float32)
    assert got.shape == want.shape == (queries, *shape)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)  # fp32 sums in another order: 1 bf16 ulp


@pytest.mark.parametrize(("tokens", "queries"), [(64, 3), (4096, 1)])
def test_tpu_kernel_lowers_at_production_shapes(tokens, queries):
    """Hidden 4608, 8 closed blocks + the partial (fp32), bf16 out, for TPU v7x."""
    spec = jax.ShapeDtypeStruct
    sources = [spec((tokens, 4608), jnp.bfloat16)] * 8
    args = (sources, spec((tokens, 4608), jnp.float32), spec((queries, 4608), jnp.float32),
            spec((queries, 4608), jnp.bfloat16))  # fmt: skip

    def mix(sources, partial, queries, weights):
        return tpu.attn_res_norm(sources, partial, queries, weights, eps=EPS, out_dtype=jnp.bfloat16)

    v7x = jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=v7x)):
        lowered = export.export(jax.jit(mix), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in lowered.mlir_module()


def test_entry_point_picks_a_backend():
    x = case(3, 2, 1, (4, 64), jnp.float32)
    want = reference.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16), want)  # reference on CPU
    with pytest.raises(ValueError, match="backend 'triton' is not one of auto, reference, tpu"):
        attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16, backend="triton")
