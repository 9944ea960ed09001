"""The ragged paged attention oracle equals whole-sequence relative attention: every sequence's keys
scattered into random pages (full layers) or its ring (sliding layers), queries as decode (1), verify
(γ + 1), prefill chunks and idle slots in one batch, with and without a window, extents shorter and
longer than the context, GQA; and the helpers the kernels share (`blocks`). The kernels' own tests
(tests/kernels/test_ragged_paged_attention_{tpu,gpu}.py) check them against this oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import blocks, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import query_positions, ring_positions
from pallas_kernels.relative_attention import relative_attention
from pallas_kernels.relative_attention.reference import relative_bias

PAGE, HEADS, KV_HEADS, DIM, D_REL = 8, 4, 2, 16, 4
WIDTH = 8  # the step's query width C


def random_case(seed: int, kv_lens: list[int], query_lens: list[int], extent: int) -> dict:
    rng = np.random.default_rng(seed)
    slots, longest = len(kv_lens), max(kv_lens)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    return {
        "q": normal(slots, longest, HEADS, DIM),
        "k": normal(slots, longest, KV_HEADS, DIM),
        "v": normal(slots, longest, KV_HEADS, DIM),
        "rel": normal(slots, longest, HEADS, D_REL),
        "sinks": normal(slots, longest, HEADS),
        "rel_proj": normal(D_REL, extent),
        "kv_lens": np.asarray(kv_lens, np.int32),
        "query_lens": np.asarray(query_lens, np.int32),
        "rng": rng,
    }


def whole_sequences(case: dict, window: int | None) -> np.ndarray:
    """[S, longest, Hq, D]: every position's output from a whole-sequence pass (the truth)."""
    positions = jnp.broadcast_to(jnp.arange(case["q"].shape[1], dtype=jnp.int32), case["q"].shape[:2])
    return np.asarray(
        jax.jit(relative_attention, static_argnames=("scale", "window"))(  # one program, not an op at a time
            case["q"],
            case["k"],
            case["v"],
            case["rel"],
            case["rel_proj"],
            case["sinks"],
            positions,
            positions,
            scale=DIM**-0.5,
            window=window,
        )
    )


def step_inputs(case: dict, width: int = WIDTH) -> dict:
    """The step's queries [S, C, ...]: each slot's last query_lens[s] positions, padded with noise."""
    rng, slots = case["rng"], len(case["kv_lens"])
    out = {}
    for name in ("q", "rel", "sinks"):
        full = case[name]
        step = rng.normal(size=(slots, width, *full.shape[2:])).astype(np.float32)
        for s, (length, count) in enumerate(zip(case["kv_lens"], case["query_lens"], strict=True)):
            step[s, :count] = full[s, length - count : length]
        out[name] = step
    return out


def paged(case: dict, num_pages: int, max_pages: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k pages, v pages [P, Hkv, page, D], page table [S, max pages]): random distinct pages, noise elsewhere."""
    rng, slots = case["rng"], len(case["kv_lens"])
    k_pages = rng.normal(size=(num_pages, KV_HEADS, PAGE, DIM)).astype(np.float32)
    v_pages = rng.normal(size=(num_pages, KV_HEADS, PAGE, DIM)).astype(np.float32)
    table = rng.permutation(num_pages)[: slots * max_pages].reshape(slots, max_pages).astype(np.int32)
    for s, length in enumerate(case["kv_lens"]):
        for p in range(length):
            k_pages[table[s, p // PAGE], :, p % PAGE] = case["k"][s, p]
            v_pages[table[s, p // PAGE], :, p % PAGE] = case["v"][s, p]
    return k_pages, v_pages, table


def rings(case: dict, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's last `size` keys [S, Hkv, size, D] at slot position % size (noise where nothing was written)."""
    rng, slots = case["rng"], len(case["kv_lens"])
    k_ring = rng.normal(size=(slots, KV_HEADS, size, DIM)).astype(np.float32)
    v_ring = rng.normal(size=(slots, KV_HEADS, size, DIM)).astype(np.float32)
    for s, length in enumerate(case["kv_lens"]):
        for p in range(max(0, length - size), length):
            k_ring[s, :, p % size], v_ring[s, :, p % size] = case["k"][s, p], case["v"][s, p]
    return k_ring, v_ring


PRODUCTION_HEADS, PRODUCTION_KV_HEADS, PRODUCTION_DIM = 48, 8, 128


def production_operands(slots: int, width: int, ring: bool, d_rel: int = 16) -> tuple:
    """Abstract (q, k, v, kv_lens, query_lens, rel, rel_proj, sinks) at Inkling 2 Small's attention shapes, for the
    lowering tests: 48 query / 8 KV heads of 128, bf16, relative extent 1024; K/V as a pool of 64 pages of 128
    tokens, or (`ring`) each slot's ring of a 1024 window and a 512-token step."""
    heads, kv_heads, dim = PRODUCTION_HEADS, PRODUCTION_KV_HEADS, PRODUCTION_DIM
    kv_shape = (slots, kv_heads, 1024 + 512, dim) if ring else (64, kv_heads, 128, dim)
    spec = jax.ShapeDtypeStruct
    return (
        spec((slots, width, heads, dim), jnp.bfloat16),
        spec(kv_shape, jnp.bfloat16),
        spec(kv_shape, jnp.bfloat16),
        spec((slots,), jnp.int32),
        spec((slots,), jnp.int32),
        spec((slots, width, heads, d_rel), jnp.bfloat16),
        spec((d_rel, 1024), jnp.bfloat16),
        spec((slots, width, heads), jnp.bfloat16),
    )


def among_other_layers(rng: np.random.Generator, *rings: np.ndarray, before: int = 2) -> tuple:
    """Each of `rings` [S, ...] scattered over a stack of rings [(before + 2) * S, ...] (the other rows noise: other
    layers' and slots'), sequence s's at a random row, and those rows [S]: the kernels read each sequence's ring in
    place, wherever it is."""
    slots = rings[0].shape[0]
    rows = rng.permutation((before + 2) * slots)[:slots].astype(np.int32)

    def scattered(ring: np.ndarray) -> np.ndarray:
        stack = rng.normal(size=((before + 2) * slots, *ring.shape[1:])).astype(ring.dtype)
        stack[rows] = ring
        return stack

    return (*(scattered(ring) for ring in rings), jnp.asarray(rows))


def check(case: dict, got: jax.Array, window: int | None) -> None:
    truth = whole_sequences(case, window)
    got = np.asarray(got)
    for s, (length, count) in enumerate(zip(case["kv_lens"], case["query_lens"], strict=True)):
        np.testing.assert_allclose(got[s, :count], truth[s, length - count : length], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(got[s, count:], 0.0)


# decode, verify (γ + 1 = 8), a prefill chunk, a first chunk, an idle slot, a chunk of 3
MIXED = ([37, 29, 61, 8, 1, 20], [1, 8, 8, 8, 0, 3])


@pytest.mark.slow
@pytest.mark.parametrize("extent", [5, 64])
@pytest.mark.parametrize("window", [None, 6])
def test_paged_layout_equals_whole_sequences(extent, window):
    case = random_case(extent + (window or 0), *MIXED, extent)
    k_pages, v_pages, table = paged(case, num_pages=64, max_pages=8)
    step = step_inputs(case)
    got = jax.jit(ragged_paged_attention, static_argnames=("scale", "window"))(
        step["q"],
        k_pages,
        v_pages,
        case["kv_lens"],
        case["query_lens"],
        step["rel"],
        case["rel_proj"],
        step["sinks"],
        page_table=table,
        scale=DIM**-0.5,
        window=window,
    )
    check(case, got, window)


@pytest.mark.parametrize("extent", [5, 64])
def test_ring_layout_equals_whole_sequences(extent):
    window = 6
    case = random_case(extent, *MIXED, extent)
    k_ring, v_ring = rings(case, size=window + WIDTH)  # a ring of window + chunk, as the decode state keeps
    k_ring, v_ring, rows = among_other_layers(case["rng"], k_ring, v_ring)
    step = step_inputs(case)
    got = ragged_paged_attention(
        step["q"],
        k_ring,
        v_ring,
        case["kv_lens"],
        case["query_lens"],
        step["rel"],
        case["rel_proj"],
        step["sinks"],
        page_table=None,
        scale=DIM**-0.5,
        window=window,
        ring_rows=rows,
    )
    check(case, got, window)


@pytest.mark.slow
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize(("width", "extent", "block"), [(8, 24, 8), (1, 1024, 128), (64, 100, 16), (8, 6, 14)])
def test_the_kernels_bias_frame_is_the_gathered_bias(ring, width, extent, block):
    """`blocks.frame_bias` (a band built by padding and re-pitching rows, no gather) equals the oracle's
    gathered bias at every key slot a query can see: positions past a pool frame's start, ring slots
    holding the last ring-size positions (wrapped up to three times)."""
    rng = np.random.default_rng(width + extent)
    capacity = extent + width if ring else 8 * extent
    block = blocks.ring_block(capacity, block) if ring else block
    kv_lens = rng.integers(0, 3 * capacity if ring else capacity, 6).astype(np.int32)
    query_lens = np.minimum(rng.integers(0, width + 1, 6), kv_lens).astype(np.int32)
    rel = rng.normal(size=(6, width, 3, D_REL)).astype(np.float32)
    rel_proj = rng.normal(size=(D_REL, extent)).astype(np.float32)
    plan = blocks.plan_blocks(
        kv_lens, query_lens, width=width, block=block, capacity=capacity, extent=extent, window=None, ring=ring
    )
    got = blocks.frame_bias(jnp.asarray(rel), rel_proj, kv_lens, query_lens, plan, kv_heads=1, ring=ring)
    got = got.reshape(6, 3, width, -1)  # three query heads reading one KV head: back to [S, Hq, C, frame]
    frame = plan.frame_blocks * plan.block
    if ring:
        keys = ring_positions(frame, kv_lens)
    else:
        keys = plan.bias_first[:, None] * plan.block + jnp.arange(frame)[None, :]
    queries = query_positions(kv_lens, query_lens, width)
    want = relative_bias(rel, rel_proj, queries, keys)
    seen = (queries[:, None, :, None] >= keys[:, None, None, :]) & (keys[:, None, None, :] >= 0)
    assert seen.sum() > 100
    np.testing.assert_array_equal(np.where(seen, got, 0.0), np.where(seen, want, 0.0))


@pytest.mark.parametrize(("window", "ring"), [(None, None), (5, None), (None, 24), (7, 24)])
def test_visible_blocks_cover_every_visible_key_and_no_more(window, ring):
    """The blocks a tile of steps c_first ... c_last visits hold every key its real queries see; on the pool its
    first and last block each hold one (no block is walked in vain), and a tile of padding visits none."""
    rng = np.random.default_rng(3 + (window or 0) + (ring or 0))
    block, width = 4, 9
    kv_lens = rng.integers(1, 60, 400)
    query_lens = np.minimum(rng.integers(0, width + 1, 400), kv_lens)
    c_first = rng.integers(0, width, 400)
    c_last = np.minimum(c_first + rng.integers(0, 4, 400), width - 1)
    lo, hi = blocks.visible_blocks(
        jnp.asarray(kv_lens),
        jnp.asarray(query_lens),
        jnp.asarray(c_first),
        jnp.asarray(c_last),
        block=block,
        window=window,
        ring=ring,
    )
    for kv, ql, c0, c1, a, b in zip(kv_lens, query_lens, c_first, c_last, np.asarray(lo), np.asarray(hi), strict=True):
        queries = [kv - ql + c for c in range(c0, min(c1, ql - 1) + 1)]
        seen = {p for q in queries for p in range(q + 1) if window is None or q - p < window}
        if ring is not None:
            seen = {p for p in seen if p > kv - 1 - ring}  # what the ring still holds, at slot p % ring
        held = {(p % ring if ring else p) // block for p in seen}
        assert held <= set(range(a, b)), (kv, ql, c0, c1, a, b)
        if not queries:
            assert a == b == 0
        elif ring is None:
            assert {a, b - 1} <= held
    assert (np.asarray(hi) > np.asarray(lo)).sum() > 150  # tiles with real queries


def test_the_entry_point_names_an_unknown_backend():
    case = random_case(1, [5], [1], extent=5)
    k_pages, v_pages, table = paged(case, num_pages=2, max_pages=1)
    step = step_inputs(case)
    args = (step["q"], k_pages, v_pages, case["kv_lens"], case["query_lens"], step["rel"], case["rel_proj"])
    with pytest.raises(ValueError, match="'triton' is not one of auto, reference, tpu, gpu"):
        ragged_paged_attention(*args, step["sinks"], page_table=table, scale=1.0, window=None, backend="triton")
