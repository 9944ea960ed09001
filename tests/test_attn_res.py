"""The fused attention-residual mix + RMSNorm: the oracle matches the definition computed token by token in float64
(the model's parity with transformers checks it inside the whole model), and the Mosaic TPU kernel matches the
oracle in Pallas' TPU interpret mode with race detection (sources of mixed scales and dtypes, 1 or 3 queries,
token counts that leave a partial tile) and lowers for TPU v7x at the production shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import race_checked

from pallas_kernels.attn_res import attn_res_norm, reference, tpu, xla

EPS = 1e-5


def case(
    seed: int, count: int, queries: int, shape: tuple[int, ...], partial_dtype: jnp.dtype, query_scale: float = 0.5
) -> dict:
    """Random sources whose scales differ by orders of magnitude (block sums grow with depth), a partial
    in `partial_dtype`, random queries (of std `query_scale`) and norm gains."""
    keys = jax.random.split(jax.random.key(seed), count + 4)
    hidden = shape[-1]
    scales = jnp.exp(jax.random.uniform(keys[0], (count + 1,), minval=-2.0, maxval=4.0))
    sources = [
        (jax.random.normal(keys[i + 1], shape) * scales[i]).astype(jnp.bfloat16) for i in range(count)
    ]  # fmt: skip
    partial = (jax.random.normal(keys[count + 1], shape) * scales[count]).astype(partial_dtype)
    return {
        "sources": sources, "partial": partial,
        "queries": jax.random.normal(keys[count + 2], (queries, hidden)) * query_scale,
        "norm_weights": (1 + 0.2 * jax.random.normal(keys[count + 3], (queries, hidden))).astype(jnp.bfloat16),
    }  # fmt: skip


def loops(sources, partial, queries, norm_weights) -> np.ndarray:
    """The definition token by token in float64: [Q, M, H] before the final rounding."""
    rows = np.stack([np.asarray(x, np.float64).reshape(-1, x.shape[-1]) for x in (*sources, partial)], axis=1)
    out = np.empty((len(queries), *rows[:, 0].shape))
    for m, token in enumerate(rows):  # token [N + 1, H]
        normed = token / np.sqrt((token**2).mean(axis=-1, keepdims=True) + 1e-6)
        pairs = zip(np.asarray(queries, np.float64), np.asarray(norm_weights, np.float64), strict=True)
        for q, (query, gain) in enumerate(pairs):
            logits = normed @ query / np.sqrt(token.shape[-1])
            p = np.exp(logits - logits.max())
            mixed = (p / p.sum()) @ normed
            out[q, m] = gain * mixed / np.sqrt((mixed**2).mean() + EPS)
    return out


@pytest.mark.parametrize(("count", "queries"), [(0, 1), (3, 3), (8, 1)])
def test_reference_matches_the_definition(count, queries):
    x = case(count, count, queries, (2, 5, 64), jnp.float32)
    got = np.asarray(reference.attn_res_norm(**x, eps=EPS, out_dtype=jnp.float32))
    want = loops(**x).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def interpreted(**inputs) -> jax.Array:
    """The TPU kernel's output in interpret mode, failing on any race between its DMAs and compute."""
    return race_checked(lambda _: tpu.attn_res_norm(**inputs, eps=EPS, out_dtype=jnp.bfloat16))


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


@pytest.mark.parametrize(("count", "queries"), [(0, 1), (3, 3), (8, 1)])
def test_xla_formulation_matches_the_reference(count, queries):
    x = case(20 + count, count, queries, (2, 7, 256), jnp.float32)
    got = np.asarray(xla.attn_res_norm(**x, eps=EPS, out_dtype=jnp.float32))
    want = np.asarray(reference.attn_res_norm(**x, eps=EPS, out_dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rounded = xla.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16)
    assert rounded.dtype == jnp.bfloat16 and rounded.shape == (queries, 2, 7, 256)


def production_operands(tokens: int, queries: int) -> tuple:
    """Abstract operands at the production width: hidden 4608, 8 closed blocks (bf16) + the fp32 partial."""
    spec = jax.ShapeDtypeStruct
    sources = [spec((tokens, 4608), jnp.bfloat16)] * 8
    return (sources, spec((tokens, 4608), jnp.float32), spec((queries, 4608), jnp.float32),
            spec((queries, 4608), jnp.bfloat16))  # fmt: skip


@pytest.mark.parametrize(("tokens", "queries"), [(64, 3), (4096, 1)])
def test_tpu_kernel_lowers_at_production_shapes(tokens, queries):
    """Hidden 4608, 8 closed blocks + the partial (fp32), bf16 out, for TPU v7x."""
    args = production_operands(tokens, queries)

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
    with pytest.raises(ValueError, match="backend 'triton' is not one of auto, reference, tpu, gpu, xla"):
        attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16, backend="triton")


def test_the_model_through_the_tpu_kernel(monkeypatch):
    """The tiny parity model's whole-sequence forward with every mix + norm (both per layer and the final one)
    running the TPU kernel in interpret mode: the same log-probabilities as through the oracle."""
    import functools

    from test_step import FIXTURE, full_logprobs

    import inkling_jax.model.text as text
    from inkling_jax.checkpoint import load_causal_lm
    from pallas_kernels import attn_res

    model = load_causal_lm(FIXTURE / "hf", jnp.float32)[1]
    ids = np.load(FIXTURE / "reference.npz")["input_ids"].tolist()[:14]
    want = full_logprobs(model, ids)
    calls = []

    def through_tpu(*args, **kwargs):
        calls.append(len(args[0]))
        return attn_res.attn_res_norm(*args, **kwargs, backend="tpu")

    monkeypatch.setattr(text, "attn_res_norm", functools.wraps(attn_res.attn_res_norm)(through_tpu))
    jax.clear_caches()
    try:
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            got = full_logprobs(model, ids)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
        jax.clear_caches()
    assert calls  # traced through the kernel
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_per_device_on_the_engines_mesh():
    """On the engine's kind of mesh (data x model, automatic axes) with the tokens split over `data`, a kernel
    wrapped by `per_device` sees whole operands on every device and returns the replicated whole."""
    import functools

    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.attn_res import per_device

    x = case(6, 2, 3, (16, 256), jnp.float32)
    kernel = functools.partial(reference.attn_res_norm, eps=EPS, out_dtype=jnp.bfloat16)
    want = np.asarray(kernel(x["sources"], x["partial"], x["queries"], x["norm_weights"]), np.float32)
    seen = []

    def whole(sources, partial, queries, weights):
        seen.append(partial.shape)
        return kernel(sources, partial, queries, weights)

    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        sources = [jax.device_put(s, NamedSharding(mesh, P("data", None))) for s in x["sources"]]
        got = jax.jit(lambda *a: per_device(whole, *a))(sources, x["partial"], x["queries"], x["norm_weights"])
    assert seen == [(16, 256)] and got.sharding.spec == P()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-7, atol=1e-6)
