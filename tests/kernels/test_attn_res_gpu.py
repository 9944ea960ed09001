"""The Mosaic GPU attention-residual kernel against the oracle on fresh random data: sources of scales that differ
by orders of magnitude, 0, 3 or 8 closed blocks, 1 or 3 queries, odd token counts and leading shapes, the
partial in fp32 or bf16, fp32 and bf16 outputs; bad shapes rejected; and lowering for CUDA at the production
shapes (Mosaic GPU's layouts, reductions and copies, which the interpreter does not check; ptxas runs only on
a GPU). On an H200 every case runs compiled at hidden 4608; on CPU in Mosaic GPU's interpreter at hidden 512 (and 1536,
where a warpgroup's copies land in three parts).
With a count of real sources (a stacked buffer with NaN and inf past it, or a list; traced, and carried by a
scan), the kernel's call on the leading sources alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from test_attn_res import case as operands
from test_attn_res import leading, poisoned, production_operands, scanned

from pallas_kernels.attn_res import attn_res_norm, gpu, reference

CPU = jax.default_backend() == "cpu"
HIDDEN = 512 if CPU else 4608
EPS = 1e-5


def case(seed: int, count: int, queries: int, shape: tuple[int, ...], partial_dtype: jnp.dtype) -> dict:
    """test_attn_res's random operands, the queries scaled so the logits span a few units at any H."""
    return operands(seed, count, queries, shape, partial_dtype, query_scale=8 / shape[-1] ** 0.5)


def mixed(x: dict, out_dtype: jnp.dtype, backend: str) -> np.ndarray:
    return np.asarray(attn_res_norm(**x, eps=EPS, out_dtype=out_dtype, backend=backend), np.float32)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("count", "queries", "shape", "partial_dtype"),
    [
        (0, 1, (3, HIDDEN), jnp.bfloat16),
        (3, 3, (2, 5, HIDDEN), jnp.float32),
        (8, 1, (7, HIDDEN), jnp.float32),
        (8, 3, (1, HIDDEN), jnp.bfloat16),
    ],
)
def test_kernel_matches_the_reference(count, queries, shape, partial_dtype):
    x = case(count + queries, count, queries, shape, partial_dtype)
    got, want = mixed(x, jnp.float32, "gpu"), mixed(x, jnp.float32, "reference")
    assert got.shape == (queries, *shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # fp32 sums in another order
    got, want = mixed(x, jnp.bfloat16, "gpu"), mixed(x, jnp.bfloat16, "reference")
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=1e-6)  # then one bf16 rounding: 1 ulp apart at most


@pytest.mark.slow
@pytest.mark.parametrize(("valid", "queries", "stacked"), [(0, 1, True), (3, 3, True), (8, 1, True), (5, 3, False)])
def test_kernel_takes_a_count_of_real_sources(valid, queries, stacked):
    """8 sources with NaN and inf past the count (their rows not copied, SMEM left as it was: NaN in the
    interpreter), stacked or listed: the kernel's call on sources[:valid] and the oracle's."""
    x = case(20 + valid, 8, queries, (3, HIDDEN), jnp.float32)
    buffer = poisoned(x["sources"], valid)
    x_valid = {**x, "sources": buffer if stacked else list(buffer), "valid": jnp.int32(valid)}
    x_alone = {**x, "sources": x["sources"][:valid]}
    got = mixed(x_valid, jnp.float32, "gpu")
    np.testing.assert_allclose(got, mixed(x_alone, jnp.float32, "gpu"), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, mixed(x_alone, jnp.float32, "reference"), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_copies_landing_in_parts():
    """A warpgroup's row copies land in up to LANDINGS parts that cover its chunks once, in order; at hidden 1536
    (three chunks a warpgroup, three parts) with masked sources arriving on each part's barrier, the oracle on
    the real sources."""
    for hidden in (512, 1536, 4608, 9216):
        parts = gpu._landings(hidden)
        assert [c for part in parts for c in part] == list(range(hidden // gpu.WARPGROUPS // gpu.CHUNK))
        assert len(parts) == min(gpu.LANDINGS, hidden // gpu.WARPGROUPS // gpu.CHUNK)
    x = case(40, 8, 3, (2, 1536 if CPU else HIDDEN), jnp.float32)
    buffer = poisoned(x["sources"], 5)
    got = mixed({**x, "sources": buffer, "valid": jnp.int32(5)}, jnp.float32, "gpu")
    want = mixed({**x, "sources": x["sources"][:5]}, jnp.float32, "reference")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_kernel_in_a_scan():
    """The kernel carried by the decoder's kind of scan (traced count, buffer filled block by block): each step
    the oracle on the blocks closed so far."""
    x = case(30, 3, 3, (2, HIDDEN), jnp.float32)
    rest = {"queries": x["queries"], "norm_weights": x["norm_weights"], "eps": EPS, "out_dtype": jnp.float32}

    def mix(buffer, partial, count):
        return attn_res_norm(buffer, partial, **rest, valid=count, backend="gpu")

    want = leading(jax.jit(lambda sources, partial: reference.attn_res_norm(sources, partial, **rest)), x)
    for got, w in zip(scanned(mix, x), want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


def test_fp32_sources_and_a_dominant_source():
    """fp32 closed blocks; one source so large and so aligned with the query that its softmax weight is ~1."""
    x = case(5, 2, 1, (4, HIDDEN), jnp.float32)
    x["sources"] = [s.astype(jnp.float32) for s in x["sources"]]
    x["sources"][1] = x["queries"][0] * 1e4 + x["sources"][1]
    np.testing.assert_allclose(mixed(x, jnp.float32, "gpu"), mixed(x, jnp.float32, "reference"), rtol=1e-5, atol=1e-5)


def test_auto_picks_the_kernel_where_it_takes_the_shape():
    """On GPU `auto` is the kernel for the shapes it takes (bit for bit), the XLA paths for others; on CPU the
    oracle."""
    x = case(7, 2, 1, (3, HIDDEN), jnp.float32)
    want = mixed(x, jnp.bfloat16, "reference" if CPU else "gpu")
    np.testing.assert_array_equal(mixed(x, jnp.bfloat16, "auto"), want)
    odd = case(8, 2, 1, (3, 768), jnp.float32)  # H not a multiple of 512
    np.testing.assert_array_equal(mixed(odd, jnp.bfloat16, "auto"), mixed(odd, jnp.bfloat16, "reference"))


def test_rejects_what_it_does_not_take():
    x = case(0, 2, 1, (4, 768), jnp.float32)
    with pytest.raises(ValueError, match=r"needs H \(768\) to be a multiple of 512"):
        gpu.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16)
    x = case(0, 12, 1, (1, 4608), jnp.float32)
    x["sources"] = [s.astype(jnp.float32) for s in x["sources"]]
    with pytest.raises(ValueError, match="holds a token's 12 sources and partial in SMEM"):
        gpu.attn_res_norm(**x, eps=EPS, out_dtype=jnp.bfloat16)
    x = case(0, 2, 1, (4, 512), jnp.float32)
    with pytest.raises(ValueError, match="must have the partial's shape"):
        gpu.attn_res_norm(
            x["sources"] + [x["partial"][:2]],
            **{k: v for k, v in x.items() if k != "sources"},
            eps=EPS,
            out_dtype=jnp.bfloat16,
        )
    rest = {k: v for k, v in x.items() if k != "sources"}
    with pytest.raises(ValueError, match="must have the partial's shape"):  # a stacked buffer of other rows
        gpu.check(jnp.zeros((2, 3, 512)), **rest)
    stacked = jnp.zeros((12, 1, 4608), jnp.float32)
    with pytest.raises(ValueError, match="holds a token's 12 sources and partial in SMEM"):
        gpu.check(stacked, stacked[0], jnp.zeros((1, 4608)), jnp.zeros((1, 4608)))
    gpu.check(jnp.stack(x["sources"]), **rest)  # takes what it takes listed


@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("tokens", [1, *(pytest.param(tokens, marks=pytest.mark.slow) for tokens in (64, 4096))])
def test_lowers_for_cuda_at_production_shapes(tokens, queries):
    """Hidden 4608, 8 closed blocks (bf16) + the fp32 partial, bf16 out."""
    args = production_operands(tokens, queries)

    def mix(sources, partial, queries, weights):
        return gpu.attn_res_norm(sources, partial, queries, weights, eps=EPS, out_dtype=jnp.bfloat16)

    lowered = export.export(jax.jit(mix), platforms=["cuda"])(*args)
    assert "mosaic_gpu" in lowered.mlir_module()


@pytest.mark.slow
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("tokens", [1, 4096])  # one token a CTA: the count is the grid's (64 lowers above)
@pytest.mark.parametrize("stacked", [True, False])
def test_lowers_for_cuda_with_a_count(tokens, queries, stacked):
    """The scan's operands at the production shapes: 8 bf16 blocks (one stacked buffer, or listed), the fp32
    partial and a traced count."""
    sources, *args = production_operands(tokens, queries)
    if stacked:
        sources = jax.ShapeDtypeStruct((len(sources), *sources[0].shape), sources[0].dtype)

    def mix(sources, partial, queries, weights, valid):
        return gpu.attn_res_norm(sources, partial, queries, weights, eps=EPS, out_dtype=jnp.bfloat16, valid=valid)

    lowered = export.export(jax.jit(mix), platforms=["cuda"])(sources, *args, jax.ShapeDtypeStruct((), jnp.int32))
    assert "mosaic_gpu" in lowered.mlir_module()
