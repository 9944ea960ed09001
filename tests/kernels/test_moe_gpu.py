"""The Mosaic GPU expert kernels against the oracle: the GPU layout's round trip, every stored value decoded exactly
(identity activations read the dequantized weight back through the whole kernel: TMA, decode, wgmma, transposed
ladder stores), the routed experts of random tokens (decode tiles, several tiles, expert parallelism's dropped ids
and fp32 partials), a token's products the same bits at every token count, bad input, and lowering for CUDA at the
production shapes. On an H200 everything is compiled; on CPU the kernels run in Mosaic GPU's interpreter (conftest's
8 host devices), at smaller sizes, with values kept out of fp32's subnormal range (XLA:CPU flushes it; the H200 run
covers it).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import devices
from pallas_kernels.moe import gpu, gpu_work, kernel_platform, moe_experts, reference
from pallas_kernels.moe.layouts import (
    PLAIN,
    GpuWeight,
    for_gpu,
    gpu_k_order,
    in_gpu_k_order,
    nvfp4_gpu_columns,
    paired_rows,
    rows_in_gpu_k_order,
)
from pallas_kernels.moe.routing import route
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray, quantize

CPU = jax.default_backend() == "cpu"
EXPERTS, HIDDEN, INTER = (4, 256, 256) if CPU else (16, 1536, 512)  # GPU: gate_up's K in 6 steps
DECODE_SHAPE = (192, 512) if CPU else (768, 1024)  # N, K of the decode checks: N a multiple of 192, K 2+ steps
CAPS = {"gate_cap": 4.0, "up_cap": 25.0}
FORMATS = (PLAIN, MXFP8, NVFP4)
# the oracle as one program a shape (op by op, each of its many operations compiled on its own for each new shape)
oracle = jax.jit(reference.moe_experts, static_argnames=("gate_cap", "up_cap", "out_dtype"))
dequantized = jax.jit(lambda weight: weight.dequantize(jnp.bfloat16))


def expert_weight(key: jax.Array, shape: tuple[int, int, int], fmt: str) -> jax.Array | QuantizedArray:
    values = jax.random.normal(key, shape, jnp.float32) * 0.05
    return values.astype(jnp.bfloat16) if fmt == PLAIN else quantize(values, fmt)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def every_value(key: jax.Array, n: int, k: int, fmt: str) -> jax.Array | QuantizedArray:
    """A weight [1, N, K] holding every stored byte (every E4M3 value but NaN, every pair of E2M1 codes), under
    random scales over the range the kernel takes (on CPU: values that stay fp32-normal)."""
    keys = jax.random.split(key, 3)
    if fmt == PLAIN:
        bits = jax.random.bits(keys[0], (1, n, k), jnp.uint16)
        bits = jnp.where((bits & 0x7F80) == 0x7F80, bits & 0x807F, bits)  # no inf / NaN; subnormals kept
        if CPU:
            bits = (bits & 0x807F) | 0x3F00
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
    if fmt == MXFP8:
        data = jax.random.permutation(keys[0], jnp.resize(jnp.arange(256, dtype=jnp.uint8), n * k)).reshape(1, n, k)
        data = jnp.where((data & 0x7F) == 0x7F, data ^ 1, data)
        low = 40 if CPU else 0
        scales = jax.random.randint(keys[1], (1, n, k // 32), low, 135).astype(jnp.uint8)
        scales = scales.at[0, 0, :2].set(jnp.array([low, 134], jnp.uint8))
        return QuantizedArray(jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn), scales, None, MXFP8)
    data = jax.random.permutation(keys[0], jnp.resize(jnp.arange(256, dtype=jnp.uint8), n * k // 2))
    scales = jax.random.randint(keys[1], (1, n, k // 16), 0, 0x7F).astype(jnp.uint8)  # every finite E4M3 >= 0
    global_scale = jnp.exp2(jax.random.uniform(keys[2], (1, 1, 1), minval=-12.0, maxval=4.0))
    e4m3 = jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn)
    return QuantizedArray(data.reshape(1, n, k // 2), e4m3, global_scale.astype(jnp.float32), NVFP4)


def assert_same_values(got: jax.Array, want: jax.Array) -> None:
    """Equal bf16 values (the same bits but for a zero's sign: a sum of products of -0 is +0)."""
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("paired", [False, True])
def test_gpu_layout_round_trip(fmt, paired):
    weight = every_value(jax.random.key(1), 128, 256, fmt)
    laid = for_gpu(weight, paired=paired)
    assert laid.shape == weight.shape and laid.paired == paired
    if paired:  # a warpgroup's 64 rows: 32 hidden units' gate rows, then their up rows (NVFP4: in down's K order)
        rows = np.asarray(for_gpu(weight).data)[:, paired_rows(128, laid.format)]
        np.testing.assert_array_equal(np.asarray(laid.data), rows)
        units = np.arange(64) if fmt != NVFP4 else nvfp4_gpu_columns(64)
        np.testing.assert_array_equal(paired_rows(128, laid.format)[:64], np.r_[units[:32], units[:32] + 64])
    back = laid.checkpoint_layout()
    if fmt == NVFP4:  # the global scale comes back broadcast over the rows
        broadcast = jnp.broadcast_to(weight.global_scale, (*weight.shape[:2], 1))
        weight = QuantizedArray(weight.data, weight.scales, broadcast, NVFP4)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(weight), strict=True):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_activations_take_the_kernels_k_order(fmt):
    x = jax.random.normal(jax.random.key(5), (3, 2, 512), jnp.float32).astype(jnp.bfloat16)
    order = gpu_k_order(fmt, 512)
    np.testing.assert_array_equal(np.asarray(in_gpu_k_order(x, fmt)), np.asarray(x if order is None else x[..., order]))
    rows = jax.random.randint(jax.random.key(6), (11,), 0, 6)  # gathered as 32-bit words: the same bits
    flat = x.reshape(6, 512)
    np.testing.assert_array_equal(
        np.asarray(rows_in_gpu_k_order(flat, rows, fmt)).view(np.uint16),
        np.asarray(in_gpu_k_order(flat, fmt)[rows]).view(np.uint16),
    )
    with pytest.raises(ValueError, match="16-bit activations as pairs, got float32"):
        rows_in_gpu_k_order(flat.astype(jnp.float32), rows, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_value_decodes_exactly(fmt):
    """Identity rows times w^T is w: the kernel's weight values, bit for bit the oracle's (three compute warpgroups
    of 64 rows; the routed cases below run two)."""
    n, k = DECODE_SHAPE
    assert_decodes_exactly(every_value(jax.random.key(2), n, k, fmt))


@pytest.mark.slow
@pytest.mark.parametrize("exponent", [-116, 116])
def test_nvfp4_steps_at_the_tables_edges_decode_exactly(exponent):
    """Global scales 2^-116 and 2^116 under every finite block scale: steps from 2^-125 to 448 * 2^116, the ends
    of the range where the kernel's decode tables (bf16 multiples of the step) stay exact."""
    weight = every_value(jax.random.key(3), *DECODE_SHAPE, NVFP4)
    assert_decodes_exactly(dataclasses.replace(weight, global_scale=jnp.full((1, 1, 1), 2.0**exponent, jnp.float32)))


def assert_decodes_exactly(weight: jax.Array | QuantizedArray) -> None:
    """Identity rows through the kernel give back the weight [1, N, K]'s values, bit for bit the oracle's."""
    want = dequantized(weight) if isinstance(weight, QuantizedArray) else weight
    assert_same_values(through_identity_rows(for_gpu(weight)), want[0].T)


@jax.jit
def through_identity_rows(weight: GpuWeight) -> jax.Array:
    """The kernel's product of K identity rows (K copies of the weight's one expert) and the weight [1, N, K]: [K, N]
    (one program a format and shape, shared by the decode checks)."""
    k = weight.shape[-1]
    tiles = gpu.tile_copies(route(jnp.zeros((k, 1), jnp.int32), jnp.ones((k, 1)), 1))
    rows = in_gpu_k_order(jnp.eye(k, dtype=jnp.bfloat16), weight.format)[tiles.source]
    return gpu.grouped_matmul(rows, weight, tiles, interpret=CPU)[tiles.row_of]


@pytest.mark.parametrize("tokens, routed, own", [(512, None, True), (512, 384, False), (1024, 384, True)])
def test_own_windows_start_at_the_copies_expected_per_expert(tokens, routed, own):
    """One shard of four (96 of 384 experts): 512 tokens keep ~11 copies per expert there (shared tiles, though
    their 4096 ids make 43 per held expert), 1024 ~21 (own windows)."""
    ids = np.argsort(np.random.default_rng(tokens).random((tokens, 384)), axis=1)[:, :8]
    tiles = gpu.tile_copies(route(jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape), 96, routed))
    assert tiles.widths == (gpu.OWN_TMS if own else (32,))


@pytest.mark.slow
@pytest.mark.parametrize(
    "tokens, top_k, experts",
    [(1, 8, 384), (8, 8, 384), (64, 8, 384), (300, 8, 240), (5, 3, 4), (30, 2, 4), (5, 3, 1), (300, 8, 8),
     (150, 8, 16), (300, 8, 96), (68, 8, 16)],
)  # fmt: skip  # shared tiles of 8, 24, 32; own windows (groups of up to 300 copies, several windows each; ~75; ~25;
# at most 68: widths 64 and 80 alone)
def test_visits_write_every_copy_once(tokens, top_k, experts):
    """Each kept copy's row is written by exactly one visit, of its own expert; each visit reads a whole window of
    its width within the rows and writes rows of it; the visits come in width order within their static bound; own
    windows are the narrowest width that holds them, their rows hold their copies and exceed them by at most 7 per
    expert and a window. Tokens whose kept ids are distinct are planned as such (windows sized by the tokens)."""
    rng = np.random.default_rng(tokens * experts)
    for _ in range(10):
        ids = np.argsort(rng.random((tokens, experts + 2)), axis=1)[:, :top_k] - 1  # some dropped (-1, E)
        if rng.random() < 0.5:  # skewed: most copies on a few experts
            ids = np.where(rng.random(ids.shape) < 0.7, rng.integers(0, 3, ids.shape), ids)
            ids = np.where(np.arange(top_k) == 0, ids, (ids + np.arange(top_k)) % experts)
        kept_ids = [row[(row >= 0) & (row < experts)] for row in ids]
        distinct = all(len(set(row)) == len(row) for row in kept_ids)
        assert_visits_write_every_copy_once(ids, experts, distinct)


def test_repeated_ids_keep_every_copy():
    """A token may name an expert more than once (the kernels' contract allows it): 68 tokens each naming experts
    0-3 twice make groups of 136 copies, planned in windows of every width, each copy written once."""
    ids = np.tile(np.arange(8) % 4, (68, 1))
    assert_visits_write_every_copy_once(ids, 4, distinct=False)


def assert_visits_write_every_copy_once(ids: np.ndarray, experts: int, distinct: bool) -> None:
    routing = route(jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape), experts)
    tiles = jax.tree.map(np.asarray, gpu.tile_copies(routing, distinct))
    own = tiles.source is not None
    largest = ids.shape[0] if distinct else ids.size
    assert tiles.widths == (gpu.own_widths(largest) if own else (tiles.tm,)) and tiles.rows % 8 == 0
    kept = np.asarray(routing.kept)
    rows = np.arange(kept.size) if tiles.row_of is None else tiles.row_of
    row_expert = np.full(tiles.rows, -1)  # each kept copy's row holds its expert's product
    row_expert[rows[kept]] = np.repeat(np.arange(experts), np.asarray(routing.group_sizes))
    writes = np.zeros(tiles.rows, int)
    ends = tiles.real[: len(tiles.widths)]
    for c, width in enumerate(tiles.widths):
        for v in range(ends[c - 1] if c else 0, ends[c]):
            row, first, last = tiles.first_row[v], tiles.writes_from[v], tiles.writes_to[v]
            assert row % (8 if own else width) == 0 and row + width <= tiles.rows
            assert row <= first < last <= row + width
            assert own or width == tiles.tm
            if own:  # the narrowest width that holds the window
                assert first == row and (c == 0 or last - first > tiles.widths[c - 1])
            np.testing.assert_array_equal(row_expert[first:last], tiles.expert[v])
            writes[first:last] += 1
    np.testing.assert_array_equal(writes[rows[kept]], 1)
    if own:  # each kept copy gathered into its row, few rows besides
        np.testing.assert_array_equal(tiles.source[rows[kept]], np.flatnonzero(kept))
        assert tiles.rows <= kept.size + 7 * experts + tiles.tm + 7
    assert writes.sum() == kept.sum() and ends[-1] <= tiles.expert.shape[0]


def test_own_windows_take_the_widths_their_groups_can_need():
    """The widths up to the narrowest that holds a group of the largest size."""
    assert gpu.OWN_TMS == (64, 80, 96, 112)
    assert [gpu.own_widths(n) for n in (1, 64, 65, 68, 80, 97, 112, 113, 4096)] == [
        (64,),
        (64,),
        (64, 80),
        (64, 80),
        (64, 80),
        (64, 80, 96, 112),
        (64, 80, 96, 112),
        (64, 80, 96, 112),
        (64, 80, 96, 112),
    ]


def test_windows_that_each_hold_a_group_bound_the_visits_by_the_experts(monkeypatch):
    """68 tokens' copies among 16 experts (the proxy's batch-64 decode): every group fits one window, so the plan's
    visits are bounded by the experts, and gate_up's K (4608) streams in steps of 128."""
    monkeypatch.setattr(devices, "gpu", lambda: devices.H200)
    ids = np.argsort(np.random.default_rng(68).random((68, 16)), axis=1)[:, :8]
    tiles = gpu.tile_copies(route(jnp.asarray(ids, jnp.int32), jnp.ones(ids.shape), 16), distinct_ids=True)
    assert tiles.widths == (64, 80) and tiles.expert.shape[0] == 16
    assert gpu_work.step_k(NVFP4, 4608, tiles.tm) == 128


@pytest.mark.parametrize(
    "tokens, top_k, experts", [(1, 8, 384), (8, 8, 384), (8, 8, 16), (5, 3, 4), (2, 2, 1), (12, 8, 16), (64, 8, 16)]
)
def test_chosen_experts_visit_each_once(tokens, top_k, experts):
    """One visit per distinct kept expert (real visits first, within the static bound), each reading the token rows
    (in whole tiles of 8, at least 8) and writing as many rows of its own; each kept copy's visit is its expert's;
    the visits name the experts of a layer's stacked weights from its first one."""
    rng = np.random.default_rng(tokens * experts + top_k)
    for _ in range(10):
        ids = rng.integers(-1, experts + 1, (tokens, top_k))  # repeats, and dropped ids (-1, E)
        if rng.random() < 0.5:
            ids = np.argsort(rng.random((tokens, experts + 2)), axis=1)[:, :top_k] - 1
        first = int(rng.integers(0, 4)) * experts  # the layer's first expert in a stack of layers
        plan = gpu.chosen_experts(jnp.asarray(ids, jnp.int32), experts, jnp.int32(first))
        tiles, visit = jax.tree.map(np.asarray, plan)
        kept = (ids >= 0) & (ids < experts)
        real = int(tiles.real[0])
        assert real == len(np.unique(ids[kept])) <= tiles.expert.shape[0] == min(experts, ids.size)
        np.testing.assert_array_equal(tiles.expert[:real], first + np.unique(ids[kept]))
        np.testing.assert_array_equal(tiles.expert[visit[kept]], first + ids[kept])
        assert np.all((tiles.expert >= 0) & (tiles.expert < first + experts))  # padding visits name a valid one
        assert tiles.first_row is None  # visit v writes rows v * tm ...: the kernel computes where
        tm = max(8, -(-tokens // 8) * 8)
        assert tiles.tm == tm and tiles.rows == tiles.expert.shape[0] * tm
        assert tiles.reads_tokens and tiles.writes_from is None and tiles.writes_to is None  # whole tiles of their own


@pytest.mark.parametrize(
    "tokens, top_k, experts, routed, every",
    [(8, 1, 384, None, True), (9, 8, 384, None, False), (9, 8, 16, None, True), (64, 8, 16, None, True),
     (65, 8, 16, None, False), (64, 8, 4, 16, True), (64, 8, 4, 32, False), (12, 2, 4, None, True),
     (12, 1, 4, None, False)],
)  # fmt: skip
def test_dense_routing_visits_every_token(tokens, top_k, experts, routed, every):
    """Up to 8 tokens, and up to 64 where each of the routed experts is expected to be chosen by half the tokens
    (16 experts top-8; under expert parallelism, the experts the ids were chosen among): a visit per chosen expert
    over every token; else the copies sorted by expert."""
    assert gpu.visits_every_token(tokens, top_k, experts, routed) is every


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_swiglu_in_the_epilogue_matches_the_oracle(fmt):
    """gate_up with the SwiGLU in its epilogue (K in one pipeline step) on shared tiles of 8 rows whose
    groups start at odd rows: each copy's capped SwiGLU of its expert's gate and up rows, in down's K order."""
    experts, tokens, hidden, inter = 6, 21, 256, 192  # 2I = 384: three compute warpgroups
    keys = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    gate_up = expert_weight(keys[1], (experts, 2 * inter, hidden), fmt)
    ids = jax.random.randint(keys[2], (tokens, 1), 0, experts)
    routing = route(ids, jnp.ones((tokens, 1)), experts)
    tiles = gpu.tile_copies(routing)
    assert tiles.tm == 8 and np.any(np.asarray(tiles.writes_from) % 2)
    rows = in_gpu_k_order(x, fmt)[routing.token_of]
    run = jax.jit(lambda r, w: gpu.grouped_matmul(r, w, tiles, swiglu=(4.0, 25.0), interpret=CPU)[:tokens])
    got = run(jnp.pad(rows, ((0, tiles.rows - tokens), (0, 0))), for_gpu(gate_up, paired=True))

    @jax.jit
    def swiglu_oracle(x, gate_up, ids, routing):
        values = gate_up.dequantize(jnp.bfloat16) if fmt != PLAIN else gate_up
        chosen = values[ids.reshape(-1)[routing.order]]  # each sorted copy's expert, [C, 2I, H]
        products = jnp.einsum("ch,cnh->cn", x[routing.token_of], chosen, preferred_element_type=jnp.float32)
        products = products.astype(jnp.bfloat16)
        return reference.capped_swiglu(products[:, :inter], products[:, inter:], 4.0, 25.0)

    want = swiglu_oracle(x, gate_up, ids, routing)
    units = gpu_k_order(fmt, inter)
    assert_close_to_oracle(got, want if units is None else want[:, units])


def test_the_ring_fits_shared_memory():
    """The ring's stages fit SMEM beside the rest and divide K's steps: where two stages of 256 K values do
    not fit (96 activation rows: 2 x 99.8 KB beside 55.7 KB), steps of 128 (3 stages of 49.9 KB); where two of 128
    do not fit either (bf16 weights of 192 rows beside the interpreter's 86 KB), one stage; a stage that fits nowhere
    is named."""
    weight = abstract_weight(MXFP8, 384, 4608, 4608, paired=True)
    assert gpu_work.ring(weight, 96, 256, staging=55_680) == (128, 36, 3)
    assert gpu_work.ring(weight, 8, 256, staging=6_144) == (256, 18, 3)  # a few tokens' gate_up
    plain = abstract_weight(PLAIN, 2, 4608, 2304)
    assert gpu_work.ring(plain, 96, 128, staging=86_016) == (128, 18, 1)
    with pytest.raises(ValueError, match="does not fit"):
        gpu_work.ring(weight, 96, 128, staging=200_000)


@functools.partial(jax.jit, static_argnums=range(1, 7))
def routed_case(
    seed: int, tokens: int, top_k: int, fmt: str, foreign: bool = False, experts: int = EXPERTS, hidden: int = HIDDEN
):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    gate_up = expert_weight(keys[1], (experts, 2 * INTER, hidden), fmt)
    down = expert_weight(keys[2], (experts, hidden, INTER), fmt)
    scores = jax.random.uniform(keys[3], (tokens, experts + (2 if foreign else 0)))
    experts = jnp.argsort(scores, axis=1)[:, :top_k].astype(jnp.int32) - (1 if foreign else 0)  # foreign: -1, E
    weights = jax.random.uniform(keys[4], (tokens, top_k), minval=0.05, maxval=0.5)
    return x, gate_up, down, experts, weights


def assert_close_to_oracle(got: jax.Array, want: jax.Array) -> None:
    """Within a bf16 rounding of the oracle; on CPU (the same accumulation in fp32) mostly identical."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = np.abs(want).max()
    assert scale > 0
    np.testing.assert_allclose(got, want, rtol=2**-7, atol=2**-7 * scale)
    if CPU:  # the same fp32 accumulation order
        assert (got == want).mean() > 0.99


CASES = [  # (format, tokens, top_k, foreign ids + fp32 out, experts); each format's decode is checked exactly above
    (NVFP4, 48, 1, False, 3),  # prefill: each expert's copies in tiles of their own (>= 16 copies per expert)
    (NVFP4, 3, 4, True, EXPERTS),  # decode of few tokens: each chosen expert's visit; expert parallelism's drops
    (MXFP8, 12, 2, True, EXPERTS),  # decode, dense routing: each chosen expert's visit of 16 rows; dropped ids
] + (
    []
    if CPU
    else [
        (MXFP8, 5, 2, False, EXPERTS),
        (PLAIN, 1, 2, False, EXPERTS),
        (MXFP8, 64, 8, False, EXPERTS),
        (NVFP4, 30, 8, False, EXPERTS),
        (PLAIN, 9, 8, True, EXPERTS),
    ]
)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, tokens, top_k, foreign, num_experts", CASES)
def test_routed_experts_match_oracle(fmt, tokens, top_k, foreign, num_experts):
    x, gate_up, down, experts, weights = routed_case(tokens, tokens, top_k, fmt, foreign, num_experts)
    out_dtype = jnp.float32 if foreign else None
    want = oracle(x, gate_up, down, experts, weights, **CAPS, out_dtype=out_dtype)
    laid = (for_gpu(gate_up, paired=True), for_gpu(down))
    got = jax.jit(lambda *a: moe_experts(*a, **CAPS, out_dtype=out_dtype, backend="gpu"))(x, *laid, experts, weights)
    assert got.dtype == want.dtype
    assert_close_to_oracle(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [NVFP4] if CPU else [MXFP8, NVFP4])  # the plan's property; decodes checked above
def test_a_token_gets_the_same_bits_at_every_token_count(fmt):
    """The first tokens' outputs alone (chosen experts' visits), among more in visits of every token (dense routing),
    in shared tiles (the same ids as if chosen among more experts) and among many in windows of their own: bit for bit
    the same (each work item sums its whole K in one order, whatever the plan; K of 6 steps, which a few tokens' visits
    once split over the CTAs). Each call: (tokens, the experts the ids were chosen among)."""
    top_k = 2 if CPU else 8  # of 4 experts on CPU, 16 on a GPU: dense routing
    calls = ((3, None), (12, None), (12, 8)) if CPU else ((8, None), (16, None), (64, None), (64, 64), (196, None))
    x, gate_up, down, experts, weights = routed_case(13, max(n for n, _ in calls), top_k, fmt, hidden=1536)
    laid = (for_gpu(gate_up, paired=True), for_gpu(down))
    run = jax.jit(
        lambda *a, routed: moe_experts(*a, **CAPS, routed_experts=routed, distinct_ids=True, backend="gpu"),
        static_argnames="routed",
    )
    first = calls[0][0]
    outs = [np.asarray(run(x[:n], *laid, experts[:n], weights[:n], routed=r), np.float32)[:first] for n, r in calls]
    assert np.abs(outs[0]).max() > 0
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [MXFP8] if CPU else [MXFP8, NVFP4])  # NVFP4's own windows: test_ctas_chain_their_items
def test_own_windows_of_every_width_match_oracle(fmt, monkeypatch):
    """Prefill groups of 60, 75, 90, 105 and 130 copies: windows multiplied at each of the widths (64, 80, 96, 112;
    130 as two windows of 72 and 58 rows), each writing back its own rows, on 5 CTAs that each run the pipelines of
    several widths in turn: the oracle's result."""
    monkeypatch.setattr(devices, "gpu", lambda: dataclasses.replace(devices.H200, multiprocessors=5))
    sizes = (60, 75, 90, 105, 130)
    ids = np.random.default_rng(5).permutation(np.repeat(np.arange(len(sizes)), sizes)).reshape(-1, 1)
    x, gate_up, down, _, weights = routed_case(11, ids.shape[0], 1, fmt, experts=len(sizes))
    experts = jnp.asarray(ids, jnp.int32)
    tiles = gpu.tile_copies(route(experts, weights, len(sizes)))
    ends = np.asarray(tiles.real[: len(tiles.widths)])
    assert tiles.widths == gpu.OWN_TMS and np.all(np.diff(ends, prepend=0) > 0)  # every width visited
    want = oracle(x, gate_up, down, experts, weights, **CAPS)
    laid = (for_gpu(gate_up, paired=True), for_gpu(down))
    got = jax.jit(lambda *a: moe_experts(*a, **CAPS, backend="gpu"))(x, *laid, experts, weights)
    assert_close_to_oracle(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("fmt, tokens, top_k", [(MXFP8, 6, 4), (MXFP8, 12, 1), (NVFP4, 64, 1)])  # chosen experts;
# shared tiles; own windows (CPU)
def test_ctas_chain_their_items(fmt, tokens, top_k, monkeypatch):
    """Three CTAs, each walking many work items through one pipeline (START, STEADY ..., STOP; gate_up's K in
    three steps of 256 at decode, six of 128 in own windows: rings of 3): the oracle's result (at 132 CTAs the
    interpreter's cases give most CTAs one item)."""
    monkeypatch.setattr(devices, "gpu", lambda: dataclasses.replace(devices.H200, multiprocessors=3))
    x, gate_up, down, experts, weights = routed_case(tokens, tokens, top_k, fmt, hidden=768 if CPU else HIDDEN)
    want = oracle(x, gate_up, down, experts, weights, **CAPS)
    laid = (for_gpu(gate_up, paired=True), for_gpu(down))
    got = jax.jit(lambda *a: moe_experts(*a, **CAPS, backend="gpu"))(x, *laid, experts, weights)
    assert_close_to_oracle(got, want)


@pytest.mark.slow
def test_all_copies_dropped_gives_zeros():
    x, gate_up, down, experts, weights = routed_case(0, 2, 2, MXFP8)
    got = moe_experts(
        x, for_gpu(gate_up, paired=True), for_gpu(down), experts + EXPERTS, weights, **CAPS, backend="gpu"
    )
    np.testing.assert_array_equal(np.asarray(got, np.float32), 0.0)


@pytest.mark.slow
def test_bad_input_is_named():
    x, gate_up, down, experts, weights = routed_case(0, 2, 2, MXFP8)
    laid_up, laid_down = for_gpu(gate_up, paired=True), for_gpu(down)
    with pytest.raises(ValueError, match="do not match"):
        gpu.moe_experts(x, laid_up, laid_up, experts, weights, **CAPS)
    with pytest.raises(ValueError, match="takes bf16 activations .and bf16 plain weights., got float32"):
        gpu.moe_experts(x.astype(jnp.float32), laid_up, laid_down, experts, weights, **CAPS)
    with pytest.raises(ValueError, match="gate_up is mxfp8 but down is plain"):
        gpu.moe_experts(x, laid_up, for_gpu(down.dequantize(jnp.bfloat16)), experts, weights, **CAPS)
    with pytest.raises(ValueError, match="for_gpu"):
        moe_experts(x, gate_up, down, experts, weights, **CAPS, backend="gpu")
    with pytest.raises(ValueError, match=r"gate_up laid out by for_gpu\(w, paired=True\), down unpaired"):
        gpu.moe_experts(x, for_gpu(gate_up), laid_down, experts, weights, **CAPS)
    with pytest.raises(ValueError, match=r"paired gate_up needs I \(8\) to be a multiple of 32"):
        for_gpu(jnp.zeros((1, 16, 256), jnp.bfloat16), paired=True)
    too_large = QuantizedArray(gate_up.data, gate_up.scales.at[0, 0, 0].set(140), None, MXFP8)
    with pytest.raises(ValueError, match="scale byte 140"):
        for_gpu(too_large)
    nan = jax.lax.bitcast_convert_type(jnp.uint8(0x7F), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="NaN element"):
        for_gpu(QuantizedArray(gate_up.data.at[1, 2, 3].set(nan), gate_up.scales, None, MXFP8))
    nv = quantize(jax.random.normal(jax.random.key(3), (2, 256, 256)), NVFP4)
    outside = r"block scale that is negative or NaN, or a block scale \* global scale nonzero outside \[2\^-125"
    cases = [
        (jnp.nan, 1.0),
        (jnp.nan, 0.0),
        (-2.0, 1.0),
        (-0.0, 1.0),
        (2.0**-9, 2.0**-117),
        (448, 2.0**117),
        (2.0**-9, 2.0**-120),
    ]
    for scale, global_scale in cases:
        with pytest.raises(ValueError, match=outside):
            scales = nv.scales.at[0, 1, 2].set(scale)
            for_gpu(QuantizedArray(nv.data, scales, jnp.full_like(nv.global_scale, global_scale), NVFP4))
    small = QuantizedArray(nv.data[:1, :4], jnp.ones_like(nv.scales[:1, :4]), None, NVFP4)  # every step = global
    for global_scale in (-nv.global_scale[:1], jnp.full((1, 1, 1), 2.0**-130), jnp.full((1, 1, 1), jnp.inf)):
        with pytest.raises(ValueError, match="global scale is negative, subnormal or not finite"):
            for_gpu(dataclasses.replace(small, global_scale=global_scale.astype(jnp.float32)))
    for_gpu(QuantizedArray(nv.data, nv.scales.at[0, 1, 2].set(0.0), nv.global_scale, NVFP4))  # zero steps decode
    per_row = jnp.broadcast_to(nv.global_scale, (2, 256, 1)).at[1, 7].multiply(2.0)  # per-expert decode tables
    with pytest.raises(ValueError, match="global scales that differ between rows of one expert"):
        for_gpu(QuantizedArray(nv.data, nv.scales, per_row, NVFP4))
    for_gpu(QuantizedArray(nv.data, nv.scales, jnp.broadcast_to(nv.global_scale, (2, 256, 1)), NVFP4))
    unchecked = jax.jit(for_gpu)(QuantizedArray(nv.data, nv.scales, per_row, NVFP4)).global_scale  # traced: no check
    assert np.isnan(unchecked[1]).all() and np.array_equal(unchecked[0, 0], jnp.full(256, nv.global_scale[0, 0, 0]))
    narrow = (
        GpuWeight(jnp.zeros((2, 256, 384), jnp.bfloat16), None, None, PLAIN, paired=True),
        GpuWeight(jnp.zeros((2, 384, 128), jnp.bfloat16), None, None, PLAIN),
    )
    with pytest.raises(ValueError, match=r"H \(384\) and I \(128\) to be multiples of 256"):
        gpu.moe_experts(jnp.zeros((2, 384), jnp.bfloat16), *narrow, experts, weights, **CAPS)


def abstract_weight(fmt: str, experts: int, n: int, k: int, paired: bool = False) -> GpuWeight:
    spec = jax.ShapeDtypeStruct
    if fmt == PLAIN:
        return GpuWeight(spec((experts, n, k), jnp.bfloat16), None, None, PLAIN, paired)
    if fmt == MXFP8:
        data, scales = spec((experts, n, k // 4), jnp.uint32), spec((experts, k // 32, n), jnp.uint8)
        return GpuWeight(data, scales, None, MXFP8, paired)
    scales, global_scale = spec((experts, k // 64, n), jnp.uint32), spec((experts, 1, n), jnp.float32)
    return GpuWeight(spec((experts, n, k // 8), jnp.uint32), scales, global_scale, NVFP4, paired)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fmt, tokens, experts", [(PLAIN, 8, 384), (MXFP8, 1, 384), (MXFP8, 4096, 384), (NVFP4, 64, 384), (NVFP4, 8, 48)]
)
def test_lowers_for_cuda_at_production_shapes(fmt, tokens, experts):
    hidden, inter = 4608, 2304
    args = (
        jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16),
        abstract_weight(fmt, experts, 2 * inter, hidden, paired=True),
        abstract_weight(fmt, experts, hidden, inter),
        jax.ShapeDtypeStruct((tokens, 8), jnp.int32),
        jax.ShapeDtypeStruct((tokens, 8), jnp.float32),
    )
    run = jax.jit(lambda *a: gpu.moe_experts(*a, **CAPS))
    lowered = export.export(run, platforms=["cuda"])(*args)
    assert "mosaic_gpu" in lowered.mlir_module()


@pytest.mark.slow
def test_the_moe_layer_on_gpu_laid_out_experts(monkeypatch):
    """A MoE layer whose NVFP4 experts are re-laid for the GPU kernels at load: the same output through the
    reference (the layout is exact); on CPU expert-parallel over tp2 with the laid-out weights split over experts
    (8 simulated devices), on the H200 through the compiled kernels (which `auto` picks there)."""
    import functools

    from flax import nnx
    from model_configs import WIDE_HEADS
    from moe_layer import assert_tp2_matches

    from inkling_jax.config import parse_config
    from inkling_jax.model import moe

    raw = WIDE_HEADS | {"hidden_size": HIDDEN, "moe_intermediate_size": INTER, "n_routed_experts": EXPERTS}
    text = parse_config(raw).text
    layer = moe.SparseMoeBlock(nnx.Rngs(0), text, jnp.bfloat16, NVFP4)
    x = jax.random.normal(jax.random.key(1), (2, 3, HIDDEN)).astype(jnp.bfloat16)
    want = np.asarray(layer(x), np.float32)
    moe.lay_out_experts(layer, "gpu")
    assert isinstance(layer.experts.down_proj.array(), GpuWeight)
    assert kernel_platform() == (None if CPU else "gpu")  # what the engine lays out for
    with monkeypatch.context() as patch:
        patch.setattr(moe, "moe_experts", functools.partial(moe.moe_experts, backend="reference"))
        np.testing.assert_array_equal(np.asarray(layer(x), np.float32), want)

    if CPU:  # the kernels' own tests run them in the interpreter
        assert_tp2_matches(layer, text, x, want)
    else:
        assert_close_to_oracle(layer(x), want)


@pytest.mark.slow
@pytest.mark.parametrize(("fmt", "tokens"), [(NVFP4, 3), (MXFP8, 32)])
def test_a_layer_of_a_stack_is_read_in_place(fmt, tokens):
    """Stacked layers' weights [L, E, ...] and a traced layer: that layer's own call, bit for bit (the kernels read
    it at its experts' offset in the stack, not a copy of it), through the few-token plan and the sorted copies;
    another layer gives another result."""
    cases = [routed_case(70 + layer, tokens, 2, fmt) for layer in range(3)]
    x, _, _, experts, weights = cases[1]
    laid = [(for_gpu(gate_up, paired=True), for_gpu(down)) for _, gate_up, down, _, _ in cases]
    stacked = [jax.tree.map(lambda *a: jnp.stack(a), *(pair[i] for pair in laid)) for i in range(2)]
    run = jax.jit(lambda layer, *a: moe_experts(*a, **CAPS, layer=layer, backend="gpu"))
    got = np.asarray(run(jnp.int32(1), x, *stacked, experts, weights), np.float32)
    one = jax.jit(lambda *a: moe_experts(*a, **CAPS, backend="gpu"))
    np.testing.assert_array_equal(got, np.asarray(one(x, *laid[1], experts, weights), np.float32))
    _, gate_up, down, _, _ = cases[2]  # another layer's result (the oracle's: the kernels' is checked above)
    assert not np.allclose(got, np.asarray(oracle(x, gate_up, down, experts, weights, **CAPS), np.float32))
