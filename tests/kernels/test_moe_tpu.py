"""The routed-expert TPU kernels: the load-time layout is lossless, the visit plan covers every copy exactly
once, the kernels match the oracle in Pallas' TPU interpret mode with race detection (plain bf16, MXFP8 and
NVFP4 experts; decode-sized and multi-tile batches; copies routed to other shards' experts), and they lower
for TPU v7x at Inkling 2 Small's expert shapes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from tpu_interpret import race_checked

from pallas_kernels import block_formats
from pallas_kernels.moe import for_tpu, moe_experts, reference, tpu
from pallas_kernels.moe.layouts import (
    PLAIN,
    TpuWeight,
    down_order_columns,
    e2m1_value,
    for_tpu_experts,
    nvfp4_order,
)
from pallas_kernels.moe.routing import route
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray, quantize

CAPS = {"gate_cap": 4.0, "up_cap": 25.0}
HIDDEN, INTER, EXPERTS = 512, 256, 8
# the oracle, the quantizer and the kernels as one program a shape (op by op, each of their many operations compiled
# on its own for each new shape)
oracle = jax.jit(reference.moe_experts, static_argnames=("gate_cap", "up_cap", "out_dtype"))
quantized = jax.jit(quantize, static_argnums=1)
kernels = jax.jit(tpu.moe_experts, static_argnames=("gate_cap", "up_cap", "out_dtype", "routed_experts", "interpret"))


def expert_weights(seed: int, fmt: str, experts: int = EXPERTS) -> tuple[jax.Array | QuantizedArray, ...]:
    """Random gate_up [E, 2I, H] and down [E, H, I] with per-expert scales, plain bf16 or quantized (drawn on the
    host: no program per shape)."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-1.0, 1.0, (experts, 1, 1))).astype(np.float32) * np.float32(0.05)
    gate_up = jnp.asarray(rng.standard_normal((experts, 2 * INTER, HIDDEN), np.float32) * scale)
    down = jnp.asarray(rng.standard_normal((experts, HIDDEN, INTER), np.float32) * scale)
    if fmt == PLAIN:
        return gate_up.astype(jnp.bfloat16), down.astype(jnp.bfloat16)
    return quantized(gate_up, fmt), quantized(down, fmt)


def routed(seed: int, tokens: int, top_k: int, ids: tuple[int, int]) -> tuple[jax.Array, ...]:
    """x [T, H] bf16, experts [T, k] distinct per token from range(*ids), weights [T, k]."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN), np.float32), jnp.bfloat16)
    choices = np.stack([rng.permutation(ids[1] - ids[0])[:top_k] for _ in range(tokens)])
    weights = jnp.asarray(rng.uniform(0.05, 1.0, (tokens, top_k)), jnp.float32)
    return x, jnp.asarray(choices + ids[0], jnp.int32), weights


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [PLAIN, MXFP8, NVFP4])
def test_layout_round_trips(fmt):
    gate_up, _ = expert_weights(1, fmt)
    laid_out = for_tpu(gate_up)
    assert laid_out.shape == gate_up.shape
    back = laid_out.checkpoint_layout()
    for a, b in zip(jax.tree.leaves(back)[:2], jax.tree.leaves(gate_up)[:2], strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    want = gate_up.dequantize(jnp.bfloat16) if isinstance(gate_up, QuantizedArray) else gate_up
    np.testing.assert_array_equal(laid_out.dequantize(jnp.bfloat16), jnp.swapaxes(want, 1, 2))
    if fmt != NVFP4:
        with pytest.raises(ValueError, match="only an NVFP4 gate_up is laid out in down's K order"):
            for_tpu(gate_up, in_down_order=True)
        return
    in_down_order = for_tpu(gate_up, in_down_order=True)  # the columns, and back
    columns = down_order_columns(gate_up.shape[1])
    np.testing.assert_array_equal(in_down_order.data, laid_out.data[..., columns])
    for a, b in zip(jax.tree.leaves(in_down_order.checkpoint_layout()), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_e2m1_codes_decode_from_bits():
    np.testing.assert_array_equal(e2m1_value(jnp.arange(16, dtype=jnp.uint32)), block_formats.E2M1_VALUES)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_mxfp8_value_dequantizes_exactly(dtype):
    """Every E4M3 code (NaNs included) under random scale bytes, through the kernels' MXFP8 chunk in the
    activation dtype: the fp32 product rounded once, as the oracle's dequantization."""
    codes = (np.arange(tpu.CHUNK)[:, None] + np.arange(128)[None, :]) % 256  # [K, TN]: every code in each column
    scale_bytes = np.random.default_rng(7).integers(100, 150, (tpu.CHUNK // block_formats.MX_BLOCK, 128))
    values = jnp.asarray(codes, jnp.uint8).view(jnp.float8_e4m3fn)

    def kernel(values_ref, scales_ref, out_ref, scratch):
        tpu._decode_scales(MXFP8, (values_ref, scales_ref), scratch)
        out_ref[...] = tpu._chunk(MXFP8, (values_ref, scales_ref), scratch, 0, dtype)

    got = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(codes.shape, dtype),
        interpret=pltpu.InterpretParams(),
        scratch_shapes=[pltpu.VMEM(scale_bytes.shape, jnp.float32)],
    )(values, jnp.asarray(scale_bytes, jnp.uint8))
    scales = np.repeat(np.exp2(scale_bytes.astype(np.float64) - 127), block_formats.MX_BLOCK, axis=0)
    want = (np.asarray(values, np.float32) * scales.astype(np.float32)).astype(dtype)
    assert np.isnan(np.asarray(want, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_every_nvfp4_code_dequantizes_exactly(dtype):
    """Every E2M1 code at every place of a 256-row chunk (both slots of every byte, both planes), under random
    E4M3 block scales and a global scale, through the kernels' NVFP4 chunk (codes as fp8 bitcasts): the oracle's
    values, the fp32 product rounded once, in `nvfp4_order`."""
    rng = np.random.default_rng(11)
    codes = (np.arange(tpu.CHUNK)[None, :] + np.arange(128)[:, None]) % 16  # [N, K]: each code at each place
    assert {tuple(np.unique(codes[:, k])) for k in range(tpu.CHUNK)} == {tuple(range(16))}
    scales = rng.integers(0, 0x7F, (1, 128, tpu.CHUNK // block_formats.NV_BLOCK)).astype(np.uint8)  # subnormals too
    weight = QuantizedArray(
        jnp.asarray(codes[None, :, 0::2] | codes[None, :, 1::2] << 4, jnp.uint8),
        jnp.asarray(scales).view(jnp.float8_e4m3fn),
        jnp.float32(rng.uniform(0.3, 3.0)),
        NVFP4,
    )
    laid = for_tpu(weight)
    refs = (laid.data[0], laid.scales[0], laid.global_scale[0])

    def kernel(data_ref, scales_ref, global_ref, out_ref, scratch):
        tpu._decode_scales(NVFP4, (data_ref, scales_ref, global_ref), scratch)
        out_ref[...] = tpu._chunk(NVFP4, (data_ref, scales_ref, global_ref), scratch, 0, dtype)

    got = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tpu.CHUNK, 128), dtype),
        interpret=pltpu.InterpretParams(),
        scratch_shapes=[pltpu.VMEM(refs[1].shape, jnp.float32)],
    )(*refs)
    want = weight.dequantize(dtype)[0].T[nvfp4_order(tpu.CHUNK)]
    assert (np.asarray(want, np.float32) == 0).mean() < 0.2
    np.testing.assert_array_equal(
        np.asarray(got, np.float32).view(np.uint32), np.asarray(want, np.float32).view(np.uint32)
    )


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts"),
    [
        (300, 8, 16),
        (1, 8, 40),
        *(pytest.param(*case, marks=pytest.mark.slow) for case in [(70, 4, 8), (40, 8, 2), (16, 4, 8), (9, 8, 40)]),
    ],
)  # prefill-sized groups; decode's one copy or two per expert
def test_tiles_are_each_experts_own(tokens, top_k, experts):
    """Every kept copy in a row of a tile that only its expert's visit multiplies, each tile visited once, the
    rows few beyond the copies (whole tiles per group); each visit's first rows its copies, in sorted order."""
    rng = np.random.default_rng(tokens)
    ids = np.argsort(rng.random((tokens, experts + 2)), axis=1)[:, :top_k] - 1  # some dropped (-1, E)
    routing = route(jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape), experts)
    plan = jax.tree.map(np.asarray, tpu._plan(routing))
    mean = -(-ids.size // experts)
    assert plan.rows % plan.tm == 0 and max(16, mean) <= plan.tm < max(32, 2 * mean)
    real = int(plan.real[0])
    assert real <= plan.expert.shape[0] and plan.row_of.max() < plan.rows  # within the static bounds
    tiles, owners = plan.tile[:real], plan.expert[:real]
    assert len(set(tiles)) == real and (np.diff(owners) >= 0).all()  # no tile visited twice; an expert's in a row
    row_expert = np.full(plan.rows, -1)
    for t, e in zip(tiles, owners, strict=True):
        row_expert[t * plan.tm : (t + 1) * plan.tm] = e
    kept = np.asarray(routing.kept)
    rows = plan.row_of[kept]
    np.testing.assert_array_equal(row_expert[rows], np.repeat(np.arange(experts), np.asarray(routing.group_sizes)))
    firsts, lives = plan.first_copy[:real], plan.live[:real]
    assert lives.min() >= 1 and lives.sum() == kept.sum()  # each visit's live rows: its copies, in order
    for t, first, live in zip(tiles, firsts, lives, strict=True):
        np.testing.assert_array_equal(plan.row_of[first : first + live], t * plan.tm + np.arange(live))
    assert real * plan.tm < kept.sum() + experts * plan.tm


def interpreted(*args, **kwargs) -> jax.Array:
    """The TPU kernels' output in interpret mode, failing on any race between their DMAs and compute."""
    return race_checked(lambda params: kernels(*args, **kwargs, interpret=params))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "tokens", "top_k", "ids", "experts"),
    [
        (PLAIN, 1, 4, (0, EXPERTS), EXPERTS),  # one decode token
        (MXFP8, 5, 4, (-3, EXPERTS + 3), EXPERTS),  # decode, some copies on other shards' experts
        (NVFP4, 3, 8, (0, EXPERTS), EXPERTS),
        (NVFP4, 70, 4, (-2, EXPERTS), EXPERTS),  # 280 copies, ~35 per expert: tiles of 64 rows, drops
        (MXFP8, 70, 4, (0, 40), 40),  # 280 copies over 40 experts: tiles of 16 rows, groups of two tiles
        (PLAIN, 24, 4, (0, EXPERTS), EXPERTS),  # 12 copies per expert: tiles of 16 rows
    ],
)
def test_tpu_kernels_match_the_reference(fmt, tokens, top_k, ids, experts):
    gate_up, down = expert_weights(10 + tokens, fmt, experts)
    x, chosen, weights = routed(tokens, tokens, top_k, ids)
    laid = for_tpu_experts(gate_up, down)  # as at load: NVFP4's gate_up in down's K order
    assert laid[0].in_down_order == (fmt == NVFP4)
    got = np.asarray(interpreted(x, *laid, chosen, weights, **CAPS), np.float32)
    if fmt == NVFP4 and tokens == 3:  # gate_up in its own order: the hidden rows permuted between the kernels
        apart = interpreted(x, for_tpu(gate_up), for_tpu(down), chosen, weights, **CAPS)
        np.testing.assert_array_equal(np.asarray(apart, np.float32), got)
    want = np.asarray(oracle(x, gate_up, down, chosen, weights, **CAPS), np.float32)
    assert got.shape == want.shape == (tokens, HIDDEN)
    assert np.isfinite(got).all() and np.abs(want).max() > 0.1
    # fp32 sums in another order may move a rounded projection by 1 bf16 ulp; the rest is identical
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-8 * np.abs(want).max())
    assert (got == want).mean() > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [MXFP8, NVFP4])
def test_both_grid_orders_give_the_oracle(fmt, monkeypatch):
    """Column tiles outside or visits outside (tiles of 128 columns: gate_up's two, down's four), over groups of
    two tiles each and empty experts: the same bits either way, the oracle's values."""
    monkeypatch.setattr(tpu, "LANE_OPTIONS", (128,))
    gate_up, down = expert_weights(21, fmt)
    x, chosen, weights = routed(22, 48, 4, (0, 5))  # ~38 copies for each of 5 experts: tiles of 32 rows
    laid = for_tpu_experts(gate_up, down)
    outs = []
    for visits_first in (False, True):
        monkeypatch.setattr(tpu, "_visits_first", lambda *_, first=visits_first: jnp.asarray(first))
        # traced afresh, under this patch (`kernels` would reuse a trace of these shapes)
        run = jax.jit(functools.partial(tpu.moe_experts, **CAPS), static_argnames="interpret")
        out = race_checked(lambda params, run=run: run(x, *laid, chosen, weights, interpret=params))
        outs.append(np.asarray(out, np.float32))
    np.testing.assert_array_equal(outs[0], outs[1])
    want = np.asarray(oracle(x, gate_up, down, chosen, weights, **CAPS), np.float32)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(outs[0], want, rtol=2**-6, atol=2**-8 * np.abs(want).max())


@pytest.mark.slow
def test_grid_order_reads_fewer_bytes():
    """Visits outside where each expert's copies fit one tile and there are column tiles to re-read it for;
    column tiles outside where one tile holds all the columns, or where experts span several tiles and re-reading
    their weights per visit would cost more than re-reading the rows."""
    tokens = jnp.arange(32, dtype=jnp.int32)[:, None]
    spread = tpu._plan(route((tokens + jnp.arange(2)) % EXPERTS, jnp.ones((32, 2)), EXPERTS))  # 8 copies each
    assert spread.tm == 16 and int(spread.real[0]) == int(spread.met) == EXPERTS
    rows = jnp.float32(4096.0)  # every visit's rows read once
    assert tpu._visits_first(spread, 3, 1e6, rows) and not tpu._visits_first(spread, 1, 1e6, rows)
    hot = jnp.broadcast_to(jnp.arange(2, dtype=jnp.int32), (64, 2))  # experts 0 and 1: 64 copies each
    piled = tpu._plan(route(hot, jnp.ones((64, 2)), EXPERTS, 64 * EXPERTS))  # sized for 2 copies: 16-row tiles
    assert piled.tm == 16 and int(piled.real[0]) == 8 and int(piled.met) == 2
    assert not tpu._visits_first(piled, 3, 1000.0, rows / 2)  # rows again 2 x 2048 bytes; weights 6 x 1000
    assert tpu._visits_first(piled, 3, 1000.0, rows)  # rows again 2 x 4096


@pytest.mark.slow
def test_fp32_partial_sums_for_expert_parallelism():
    """out_dtype fp32 (what a shard returns for the cross-shard sum) and a shard holding none of the experts."""
    gate_up, down = expert_weights(3, MXFP8)
    x, chosen, weights = routed(4, 6, 4, (0, EXPERTS))
    args = (x, for_tpu(gate_up), for_tpu(down), chosen, weights)
    got = interpreted(*args, **CAPS, out_dtype=jnp.float32)
    assert got.dtype == jnp.float32
    want = oracle(x, gate_up, down, chosen, weights, **CAPS, out_dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-8 * np.abs(want).max())
    elsewhere = interpreted(x, *args[1:3], chosen + EXPERTS, weights, **CAPS, out_dtype=jnp.float32)
    np.testing.assert_array_equal(elsewhere, np.zeros_like(elsewhere))


@pytest.mark.slow
def test_entry_point_picks_a_backend_and_names_bad_input():
    gate_up, down = expert_weights(4, MXFP8, experts=4)
    x, chosen, weights = routed(5, 3, 2, (0, 4))
    want = oracle(x, gate_up, down, chosen, weights, **CAPS)
    laid_out = (for_tpu(gate_up), for_tpu(down))
    np.testing.assert_array_equal(moe_experts(x, *laid_out, chosen, weights, **CAPS), want)  # reference on CPU
    with pytest.raises(ValueError, match="backend 'triton' is not one of auto, reference, tpu"):
        moe_experts(x, gate_up, down, chosen, weights, **CAPS, backend="triton")
    with pytest.raises(ValueError, match="laid out by pallas_kernels.moe.layouts.for_tpu"):
        moe_experts(x, gate_up, down, chosen, weights, **CAPS, backend="tpu")
    with pytest.raises(ValueError, match="expert shapes do not match"):
        tpu.moe_experts(x, laid_out[0], laid_out[0], chosen, weights, **CAPS)
    with pytest.raises(ValueError, match=r"routed_experts \(3\) is fewer than the 4 experts the weights hold"):
        moe_experts(x, *laid_out, chosen, weights, **CAPS, routed_experts=3)
    many = jnp.zeros((tpu.MAX_COPIES // 2 + 1, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"at most 131072 token copies a call \(65537 tokens x 2 experts given\)"):
        tpu.moe_experts(jnp.zeros((many.shape[0], HIDDEN), jnp.bfloat16), *laid_out, many, many * 0.0, **CAPS)
    small = for_tpu(jnp.zeros((2, 2 * 200, 256), jnp.bfloat16)), for_tpu(jnp.zeros((2, 256, 200), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"I \(200\) to be multiples of 256"):
        tpu.moe_experts(jnp.zeros((1, 256), jnp.bfloat16), *small, chosen[:1] % 2, weights[:1], **CAPS)


@pytest.mark.slow
def test_expert_parallel_tiles_are_sized_for_the_kept_copies():
    """One shard of four (ids over 4 x EXPERTS, three quarters dropped here): with routed_experts the own tiles
    are sized for the copies expected to stay (16 rows for ~8 per expert, not 32 for all 32 per expert), and the
    output is the same."""
    gate_up, down = expert_weights(8, MXFP8)
    x, chosen, weights = routed(9, 32, 8, (0, 4 * EXPERTS))
    sizes = [tpu._plan(route(chosen, weights, EXPERTS, routed)).tm for routed in (None, 4 * EXPERTS)]
    assert sizes == [32, 16]
    args = (x, for_tpu(gate_up), for_tpu(down), chosen, weights)
    got = interpreted(*args, **CAPS, routed_experts=4 * EXPERTS)
    want = oracle(x, gate_up, down, chosen, weights, **CAPS)
    assert np.abs(np.asarray(want, np.float32)).max() > 0.1
    np.testing.assert_allclose(
        np.asarray(got, np.float32),
        np.asarray(want, np.float32),
        rtol=2**-6,
        atol=2**-8 * np.abs(np.asarray(want, np.float32)).max(),
    )


def laid_out_spec(fmt: str, experts: int, n: int, k: int) -> TpuWeight:
    spec = jax.ShapeDtypeStruct
    if fmt == MXFP8:
        return TpuWeight(spec((experts, k, n), jnp.float8_e4m3fn), spec((experts, k // 32, n), jnp.uint8), None, MXFP8)
    return TpuWeight(
        spec((experts, 2, k // 16, n), jnp.uint32),
        spec((experts, k // 16, n), jnp.float8_e4m3fn),
        spec((experts, 1, n), jnp.float32),
        NVFP4,
    )


@pytest.mark.parametrize(
    ("fmt", "tokens", "experts"), [(MXFP8, 8, 384), (NVFP4, 64, 96), (MXFP8, 4096, 96), (NVFP4, 512, 384)]
)  # decode (tiles of 16 rows), prefill (tiles of 256 rows; of 16 for 384 experts at 512 tokens)
def test_tpu_kernels_lower_at_production_shapes(fmt, tokens, experts):
    """Hidden 4608, intermediate 2304, top-8, for TPU v7x: all 384 experts, or a quarter (tp4's expert share)."""
    spec = jax.ShapeDtypeStruct
    args = (
        spec((tokens, 4608), jnp.bfloat16),
        laid_out_spec(fmt, experts, 2 * 2304, 4608),
        laid_out_spec(fmt, experts, 4608, 2304),
        spec((tokens, 8), jnp.int32),
        spec((tokens, 8), jnp.float32),
    )

    def run(*args):
        return tpu.moe_experts(*args, **CAPS)

    v7x = jax.sharding.AbstractDevice(device_kind="TPU7x", num_cores=1, platform="tpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=v7x)):
        lowered = export.export(jax.jit(run), platforms=["tpu"])(*args)
    assert lowered.mlir_module().count("tpu_custom_call") >= 2


@pytest.mark.slow
def test_the_moe_layer_on_tpu_laid_out_experts(monkeypatch):
    """A MoE layer whose MXFP8 experts are re-laid for the TPU kernels at load: the same output through the
    reference, through the kernels in interpret mode, and expert-parallel over tp2 (8 simulated devices)."""
    from flax import nnx
    from model_configs import WIDE_HEADS
    from moe_layer import assert_tp2_matches

    from inkling_jax.config import parse_config
    from inkling_jax.model import moe

    raw = WIDE_HEADS | {"hidden_size": HIDDEN, "moe_intermediate_size": INTER, "n_routed_experts": 8}
    text = parse_config(raw).text
    layer = moe.SparseMoeBlock(nnx.Rngs(0), text, jnp.bfloat16, "mxfp8")
    x = jax.random.normal(jax.random.key(1), (2, 5, HIDDEN)).astype(jnp.bfloat16)
    want = np.asarray(layer(x), np.float32)
    moe.lay_out_experts(layer, "tpu")
    assert isinstance(layer.experts.gate_up_proj.array(), moe.TpuWeight)
    np.testing.assert_array_equal(np.asarray(layer(x), np.float32), want)

    params = pltpu.InterpretParams()
    monkeypatch.setattr(moe, "moe_experts", lambda *a, distinct_ids, **k: tpu.moe_experts(*a, **k, interpret=params))
    try:
        got = np.asarray(layer(x), np.float32)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_allclose(got, want, rtol=2**-6, atol=2**-8 * np.abs(want).max())
    monkeypatch.undo()

    assert_tp2_matches(layer, text, x, want)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "tokens"), [(NVFP4, 3), (MXFP8, 70)])
def test_a_layer_of_a_stack_is_read_in_place(fmt, tokens):
    """Stacked layers' weights [L, E, ...] and a traced layer: that layer's own call, bit for bit (the kernels read
    it at its experts' offset in the stack, not a copy of it); another layer gives another result."""
    laid = [for_tpu_experts(*expert_weights(60 + layer, fmt)) for layer in range(3)]
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *(weights[i] for weights in laid)) for i in range(2)]
    x, chosen, weights = routed(tokens, tokens, 4, (0, EXPERTS))
    got = np.asarray(interpreted(x, *stacked, chosen, weights, **CAPS, layer=jnp.int32(1)), np.float32)
    want = np.asarray(interpreted(x, *laid[1], chosen, weights, **CAPS), np.float32)
    np.testing.assert_array_equal(got, want)
    other = np.asarray(interpreted(x, *laid[2], chosen, weights, **CAPS), np.float32)
    assert not np.allclose(got, other)
