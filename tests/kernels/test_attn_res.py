"""The fused attention-residual mix + RMSNorm: the oracle matches the definition computed token by token in float64
(the model's parity with transformers checks it inside the whole model), and the Mosaic TPU kernel matches the
oracle in Pallas' TPU interpret mode with race detection (sources of mixed scales and dtypes, 1 or 3 queries,
token counts that leave a partial tile) and lowers for TPU v7x at the production shapes.

With a count of real sources (a stacked buffer whose later slots hold NaN and inf, or a list), every backend gives
the call on the leading sources alone: for counts 0, some and all, traced inside jit and carried by a lax.scan
that fills the buffer block by block as the decoder does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import race_checked

from pallas_kernels.attn_res import attn_res_norm, reference, tpu, xla

EPS = 1e-5
# the oracle and the XLA formulation as one program each per shape (called eagerly, every operation compiles alone)
ORACLE = jax.jit(reference.attn_res_norm, static_argnames=("eps", "out_dtype"))
XLA = jax.jit(xla.attn_res_norm, static_argnames=("eps", "out_dtype"))


def case(
    seed: int, count: int, queries: int, shape: tuple[int, ...], partial_dtype: jnp.dtype, query_scale: float = 0.5
) -> dict:
    """Random sources whose scales differ by orders of magnitude (block sums grow with depth), a partial
    in `partial_dtype`, random queries (of std `query_scale`) and norm gains (drawn on the host: no program per
    shape)."""
    rng = np.random.default_rng(seed)
    hidden = shape[-1]
    scales = np.exp(rng.uniform(-2.0, 4.0, count + 1)).astype(np.float32)
    sources = [jnp.asarray(rng.standard_normal(shape, np.float32) * scales[i], jnp.bfloat16) for i in range(count)]
    partial = jnp.asarray(rng.standard_normal(shape, np.float32) * scales[count], partial_dtype)
    return {
        "sources": sources,
        "partial": partial,
        "queries": jnp.asarray(rng.standard_normal((queries, hidden), np.float32) * query_scale),
        "norm_weights": jnp.asarray(1 + 0.2 * rng.standard_normal((queries, hidden), np.float32), jnp.bfloat16),
    }


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


def poisoned(sources: list[jax.Array], valid: int) -> jax.Array:
    """The sources stacked into one buffer [N, ..., H], every slot from `valid` on full of NaN, inf and -inf (what
    a buffer may hold before its blocks close)."""
    stacked = jnp.stack(sources)
    junk = jnp.array([jnp.nan, jnp.inf, -jnp.inf], stacked.dtype)[jnp.arange(stacked.shape[-1]) % 3]
    return stacked.at[valid:].set(junk)


def scanned(mix, x: dict) -> list[np.ndarray]:
    """mix(buffer, partial, count) as the decoder's scan over its blocks runs it, under jit: the carry a buffer of N
    sources (NaN until written) and the traced count of closed blocks; step i mixes the first i blocks with partial
    i, then closes block i; after the scan the mix of all N. The N + 1 results, for counts 0 ... N."""
    blocks = jnp.stack(x["sources"])
    partials = jnp.stack([x["partial"] * (1 + i) for i in range(len(blocks) + 1)])

    def step(carry, inputs):
        (buffer, count), (partial, block) = carry, inputs
        out = mix(buffer, partial, count)
        return (jax.lax.dynamic_update_index_in_dim(buffer, block, count, 0), count + 1), out

    @jax.jit
    def run(blocks, partials):
        start = (jnp.full_like(blocks, jnp.nan), jnp.int32(0))
        (buffer, count), outs = jax.lax.scan(step, start, (partials[:-1], blocks))
        return [*outs, mix(buffer, partials[-1], count)]

    return [np.asarray(out, np.float32) for out in run(blocks, partials)]


def leading(mix_list, x: dict) -> list[np.ndarray]:
    """What `scanned` should give: mix_list(sources[:i], partial i) for i = 0 ... N."""
    return [
        np.asarray(mix_list(x["sources"][:i], x["partial"] * (1 + i)), np.float32) for i in range(len(x["sources"]) + 1)
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("count", "queries"), [(0, 1), (3, 3), (8, 1)])
def test_reference_matches_the_definition(count, queries):
    x = case(count, count, queries, (2, 5, 64), jnp.float32)
    got = np.asarray(ORACLE(**x, eps=EPS, out_dtype=jnp.float32))
    want = loops(**x).reshape(got.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def interpreted(**inputs) -> jax.Array:
    """The TPU kernel's output in interpret mode, failing on any race between its DMAs and compute."""
    return race_checked(lambda _: tpu.attn_res_norm(**inputs, eps=EPS, out_dtype=jnp.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("count", "queries", "shape", "partial_dtype"),
    [(0, 1, (3, 256), jnp.bfloat16), (3, 3, (2, 13, 256), jnp.float32), (8, 1, (37, 256), jnp.float32)],
)
def test_tpu_kernel_matches_the_reference(count, queries, shape, partial_dtype):
    x = case(10 + count, count, queries, shape, partial_dtype)
    got = np.asarray(interpreted(**x), np.float32)
    want = np.asarray(ORACLE(**x, eps=EPS, out_dtype=jnp.bfloat16), np.float32)
    assert got.shape == want.shape == (queries, *shape)
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)  # fp32 sums in another order: 1 bf16 ulp


@pytest.mark.slow
@pytest.mark.parametrize(("valid", "stacked"), [(0, True), (3, True), (5, True), (2, False)])
def test_tpu_kernel_takes_a_count_of_real_sources(valid, stacked):
    """5 sources with NaN and inf past the count, stacked or listed, 3 queries, a partial tile: in interpret mode
    with race detection, the kernel's call on sources[:valid] and the oracle's."""
    x = case(50 + valid, 5, 3, (2, 13, 256), jnp.float32)
    rest = {"partial": x["partial"], "queries": x["queries"], "norm_weights": x["norm_weights"]}
    buffer = poisoned(x["sources"], valid)
    sources, count = (buffer if stacked else list(buffer)), jnp.int32(valid)
    got = race_checked(lambda _: tpu.attn_res_norm(sources, **rest, eps=EPS, out_dtype=jnp.float32, valid=count))
    alone = race_checked(lambda _: tpu.attn_res_norm(x["sources"][:valid], **rest, eps=EPS, out_dtype=jnp.float32))
    np.testing.assert_allclose(got, alone, rtol=1e-6, atol=1e-6)
    want = ORACLE(x["sources"][:valid], **rest, eps=EPS, out_dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # fp32 sums in another order


@pytest.mark.slow
def test_tpu_kernel_in_a_scan():
    """The kernel carried by the decoder's kind of scan (traced count, buffer filled block by block), in interpret
    mode with race detection: each step the oracle on the blocks closed so far."""
    x = case(60, 3, 1, (10, 256), jnp.float32)
    rest = {"queries": x["queries"], "norm_weights": x["norm_weights"], "eps": EPS, "out_dtype": jnp.float32}

    def mix(buffer, partial, count):
        return tpu.attn_res_norm(buffer, partial, **rest, valid=count)

    got = race_checked(lambda _: scanned(mix, x))
    want = leading(jax.jit(lambda sources, partial: reference.attn_res_norm(sources, partial, **rest)), x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(("count", "queries"), [(0, 1), (3, 3), (8, 1)])
def test_xla_formulation_matches_the_reference(count, queries):
    x = case(20 + count, count, queries, (2, 7, 256), jnp.float32)
    got = np.asarray(XLA(**x, eps=EPS, out_dtype=jnp.float32))
    want = np.asarray(ORACLE(**x, eps=EPS, out_dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    rounded = XLA(**x, eps=EPS, out_dtype=jnp.bfloat16)
    assert rounded.dtype == jnp.bfloat16 and rounded.shape == (queries, 2, 7, 256)


@pytest.mark.slow
@pytest.mark.parametrize("module", [reference, xla])
@pytest.mark.parametrize("valid", [0, 2, 5])
def test_a_count_of_real_sources_takes_the_leading_ones(module, valid):
    """The oracle and the XLA formulation with a count: stacked or listed, with NaN and inf past the count, the
    call on sources[:valid] (fp32 rounding apart)."""
    x = case(30 + valid, 5, 3, (2, 7, 256), jnp.float32)
    rest = {"partial": x["partial"], "queries": x["queries"], "norm_weights": x["norm_weights"]}
    want = module.attn_res_norm(x["sources"][:valid], **rest, eps=EPS, out_dtype=jnp.float32)
    buffer = poisoned(x["sources"], valid)
    for sources in (buffer, list(buffer)):
        got = module.attn_res_norm(sources, **rest, eps=EPS, out_dtype=jnp.float32, valid=jnp.int32(valid))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    unmasked = module.attn_res_norm(buffer[:valid], **rest, eps=EPS, out_dtype=jnp.float32)  # stacked, valid=None
    np.testing.assert_allclose(unmasked, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "xla"])
def test_a_traced_count_in_jit_and_in_a_scan(backend):
    """The count traced: one jit for every count, and carried by a scan that fills the buffer block by block."""
    x = case(40, 4, 3, (3, 256), jnp.float32)
    rest = {"queries": x["queries"], "norm_weights": x["norm_weights"], "eps": EPS, "out_dtype": jnp.float32}
    traces = []

    @jax.jit
    def mix(buffer, partial, count):
        traces.append(count)
        return attn_res_norm(buffer, partial, **rest, valid=count, backend=backend)

    for valid in range(5):
        want = attn_res_norm(x["sources"][:valid], x["partial"], **rest, backend=backend)
        np.testing.assert_allclose(mix(poisoned(x["sources"], valid), x["partial"], valid), want, rtol=1e-6, atol=1e-6)
    assert len(traces) == 1
    got = scanned(
        lambda buffer, partial, count: attn_res_norm(buffer, partial, **rest, valid=count, backend=backend), x
    )
    want = leading(lambda sources, partial: attn_res_norm(sources, partial, **rest, backend=backend), x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)


def production_operands(tokens: int, queries: int) -> tuple:
    """Abstract operands at the production width: hidden 4608, 8 closed blocks (bf16) + the fp32 partial."""
    spec = jax.ShapeDtypeStruct
    sources = [spec((tokens, 4608), jnp.bfloat16)] * 8
    return (
        sources,
        spec((tokens, 4608), jnp.float32),
        spec((queries, 4608), jnp.float32),
        spec((queries, 4608), jnp.bfloat16),
    )


@pytest.mark.parametrize(("tokens", "queries"), [(64, 3), (4096, 1)])
def test_tpu_kernel_lowers_at_production_shapes(tokens, queries):
    """Hidden 4608, 8 closed blocks + the partial (fp32), bf16 out, for TPU v7x."""
    args = production_operands(tokens, queries)

    def mix(sources, partial, queries, weights):
        return tpu.attn_res_norm(sources, partial, queries, weights, eps=EPS, out_dtype=jnp.bfloat16)

    assert "tpu_custom_call" in for_v7x(mix, *args)


@pytest.mark.parametrize(("tokens", "queries"), [(64, 3), (4096, 1)])
def test_tpu_kernel_with_a_count_lowers_at_production_shapes(tokens, queries):
    """The scan's operands: a stacked buffer of 8 bf16 blocks, the fp32 partial and a traced count."""
    sources, *args = production_operands(tokens, queries)
    buffer = jax.ShapeDtypeStruct((len(sources), *sources[0].shape), sources[0].dtype)

    def mix(buffer, partial, queries, weights, valid):
        return tpu.attn_res_norm(buffer, partial, queries, weights, eps=EPS, out_dtype=jnp.bfloat16, valid=valid)

    assert "tpu_custom_call" in for_v7x(mix, buffer, *args, jax.ShapeDtypeStruct((), jnp.int32))


def for_v7x(fn, *args) -> str:
    """fn(*args) exported for TPU v7x: its StableHLO text."""
    v7x = jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=v7x)):
        return export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()


@pytest.mark.slow
def test_entry_point_picks_a_backend():
    x = case(3, 2, 1, (4, 64), jnp.float32)
    want = ORACLE(**x, eps=EPS, out_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16), want)  # reference on CPU
    with pytest.raises(ValueError, match="backend 'triton' is not one of auto, reference, tpu, gpu, xla"):
        attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16, backend="triton")


@pytest.mark.slow
def test_the_model_through_the_tpu_kernel(monkeypatch, tmp_path):
    """The tiny parity model's config in four layers (two blocks of two, as the twelve are two of six; random weights)
    in a whole-sequence forward with every mix + norm (both per layer and the final one) running the TPU kernel in
    interpret mode: the same log-probabilities as through the oracle."""
    import functools

    from model_configs import four_layers
    from paths import TINY_TEXT as FIXTURE
    from step_driver import full_logprobs

    import inkling_jax.model.text as text
    from inkling_jax.checkpoint import load_causal_lm
    from inkling_jax.checkpoint.synthetic import write_checkpoint
    from pallas_kernels import attn_res

    config = four_layers(FIXTURE / "hf" / "config.json", tmp_path / "config.json")
    model = load_causal_lm(write_checkpoint(config, tmp_path / "checkpoint", experts="fp32"), jnp.float32)[1]
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_entry_point_with_a_count_on_the_engines_mesh(monkeypatch):
    """The entry point's kernel path on the engine's kind of mesh (data x model, automatic axes): `per_device` gives
    every device's kernel the whole stacked buffer and the traced count (the TPU kernel stood in for by the oracle:
    interpret mode runs one device at a time); a count that is not a scalar is refused."""
    from jax.sharding import Mesh

    x = case(70, 4, 3, (8, 256), jnp.float32)
    rest = {"queries": x["queries"], "norm_weights": x["norm_weights"], "eps": EPS, "out_dtype": jnp.float32}
    seen = []

    def whole(sources, partial, queries, norm_weights, **options):
        seen.append((sources.shape, options["valid"].shape))
        return reference.attn_res_norm(sources, partial, queries, norm_weights, **options)

    monkeypatch.setattr(tpu, "attn_res_norm", whole)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        mix = jax.jit(lambda buffer, partial, count: attn_res_norm(buffer, partial, **rest, valid=count, backend="tpu"))
        got = mix(poisoned(x["sources"], 2), x["partial"], jnp.int32(2))
    assert seen == [((4, 8, 256), ())] and got.sharding.spec == jax.sharding.PartitionSpec()
    np.testing.assert_allclose(
        got, reference.attn_res_norm(x["sources"][:2], x["partial"], **rest), rtol=1e-6, atol=1e-6
    )
    with pytest.raises(ValueError, match=r"valid must be a scalar count of sources, not of shape \(1,\)"):
        attn_res_norm(x["sources"], x["partial"], **rest, valid=jnp.array([2]))
