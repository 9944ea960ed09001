"""The routing every expert backend shares: the copies' sort and its inverse, the weighted combine (a fixed order
of additions, dropped copies never read), and the loop-free group search."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.routing import RANKED_UP_TO, combine, group_of, group_offsets, prefix_sum, route, visits


@pytest.mark.slow
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 8, 16), (37, 4, 8)])
def test_combine_sums_each_tokens_copies_in_order(tokens, top_k, experts):
    keys = jax.random.split(jax.random.key(tokens), 4)
    ids = jax.random.randint(keys[0], (tokens, top_k), -1, experts + 1)  # -1 and E: dropped (another shard's)
    weights = jax.random.uniform(keys[1], (tokens, top_k), minval=0.05, maxval=0.5)
    routing = route(ids, weights, experts)
    rows = jax.random.normal(keys[2], (tokens * top_k, 64), jnp.float32).astype(jnp.bfloat16)
    rows = jnp.where(~routing.kept[:, None], jnp.nan, rows)  # what a dropped copy's row holds must not matter
    got = np.asarray(combine(rows, routing, tokens, jnp.bfloat16), np.float32)

    order, ids, weights = np.asarray(routing.order), np.asarray(ids), np.asarray(weights)
    np.testing.assert_array_equal(np.asarray(routing.position)[order], np.arange(tokens * top_k))
    by_copy = np.empty((tokens * top_k, 64), np.float32)
    by_copy[order] = np.asarray(rows, np.float32)
    want = np.zeros((tokens, 64), np.float32)
    for j in range(top_k):  # fp32, copy 0 first, as the combine promises
        kept = (ids[:, j] >= 0) & (ids[:, j] < experts)
        term = by_copy[j::top_k] * weights[:, j, None].astype(np.float32)
        want = want + np.where(kept[:, None], term, np.float32(0))
    want = np.asarray(jnp.asarray(want).astype(jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all() and np.abs(got).max() > 0


def test_expected_copies_count_only_these_experts_share():
    """All N * k copies, or under expert parallelism the share routed to these E of routed_experts (rounded up)."""
    ids = jax.random.randint(jax.random.key(3), (10, 4), 0, 30)
    assert route(ids, jnp.ones((10, 4)), 8).expected == 40
    assert route(ids, jnp.ones((10, 4)), 8, routed_experts=30).expected == 11  # 40 * 8 / 30 = 10.7


def test_group_of_finds_each_positions_group():
    rng = np.random.default_rng(0)
    sizes = rng.integers(0, 5, 40).astype(np.int32)  # empty groups included
    ends = np.cumsum(sizes)
    positions = np.arange(ends[-1] + 3)  # and positions past the last group
    got = np.asarray(group_of(jnp.asarray(ends), jnp.asarray(positions)))
    np.testing.assert_array_equal(got, np.searchsorted(ends, positions, side="right"))
    ids = rng.integers(0, 6, (9, 2)).astype(np.int32)
    routing = route(jnp.asarray(ids), jnp.ones((9, 2)), 6)
    offsets = np.asarray(group_offsets(routing))
    groups = np.asarray(group_of(jnp.asarray(offsets[1:]), jnp.arange(18)))
    np.testing.assert_array_equal(groups, ids.reshape(-1)[np.asarray(routing.order)])  # each sorted copy's expert


@pytest.mark.parametrize("tokens", [40, RANKED_UP_TO // 4 + 1])  # 160 copies ranked by comparison; 2052 sorted
def test_copies_sorted_stably_by_expert(tokens):
    """The copies in (expert, copy) order, dropped ones last, by either sort; the group sizes and their prefix
    sums."""
    experts, top_k = 24, 4
    ids = jax.random.randint(jax.random.key(tokens), (tokens, top_k), -1, experts + 1)  # few ids: many ties
    routing = route(ids, jnp.ones((tokens, top_k)), experts)
    flat = np.asarray(ids).reshape(-1)
    keys = np.where((flat >= 0) & (flat < experts), flat, experts)
    np.testing.assert_array_equal(np.asarray(routing.order), np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(np.asarray(routing.position)[np.asarray(routing.order)], np.arange(flat.size))
    sizes = np.bincount(keys, minlength=experts + 1)[:experts]
    np.testing.assert_array_equal(np.asarray(routing.group_sizes), sizes)
    np.testing.assert_array_equal(np.asarray(group_offsets(routing)), np.concatenate([[0], np.cumsum(sizes)]))
    np.testing.assert_array_equal(np.asarray(prefix_sum(jnp.asarray(sizes, jnp.int32))), np.cumsum(sizes))


@pytest.mark.parametrize("seed", range(4))
def test_visits_cover_every_copy_once(seed):
    """One visit per (tile, expert) pair whose rows meet, a tile's visits consecutive, padding repeating the last."""
    rng = np.random.default_rng(seed)
    experts = int(rng.integers(1, 12))
    tokens, top_k = int(rng.integers(1, 60)), int(rng.integers(1, 5))
    ids = jnp.asarray(rng.integers(-2, experts + 2, size=(tokens, top_k)), jnp.int32)  # some dropped
    routing = route(ids, jnp.ones(ids.shape), experts)
    copies = tokens * top_k
    tm = min(256, -(-copies // 16) * 16)  # shared tiles of all the copies, up to 256 rows
    count = -(-copies // tm) + min(experts, copies) - 1
    expert, tile, real = (np.asarray(a) for a in visits(group_offsets(routing), tm, count))
    real = int(real[0])
    flat = np.asarray(ids).reshape(-1)
    group = np.sort(np.where((flat >= 0) & (flat < experts), flat, experts))
    visited = [(t, e) for t, e in zip(tile[:real], expert[:real], strict=True)]
    assert sorted(set(visited)) == sorted({(r // tm, g) for r, g in enumerate(group) if g < experts})
    assert len(visited) == len(set(visited))
    assert (np.diff(tile[:real]) >= 0).all()  # a tile's visits are consecutive steps
    assert all((t, e) == visited[-1] for t, e in zip(tile[real:], expert[real:], strict=True))  # padding repeats
