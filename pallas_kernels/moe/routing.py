"""Token copies sorted by expert, the (tile, expert) visits over them, and their weighted sum back into tokens:
what every expert backend shares.

Each of N tokens is routed to k experts: N * k copies. Sorting them by expert makes each expert's copies one
contiguous group, so its weights meet all its copies in one grouped matmul. A copy routed to an id outside
[0, E) belongs to no group (under expert parallelism, another shard's expert): it sorts after every group and
adds nothing. Kernels cut the sorted copies into tiles; a visit is one (tile, expert) pair whose rows meet.
"""

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import round_to


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Copy j of token n is copy n * k + j; `order` lists them by expert (stable)."""

    order: jax.Array  # [N * k] int32: the copies sorted by expert
    position: jax.Array  # [N * k] int32: where each copy sits in `order` (its inverse)
    token_of: jax.Array  # [N * k] int32: the token of each sorted copy
    weight_of: jax.Array  # [N * k] float32: its routing weight (0 for a dropped copy)
    kept: jax.Array  # [N * k] bool: whether it belongs to a group
    group_sizes: jax.Array  # [E] int32: copies per expert
    top_k: int = dataclasses.field(metadata={"static": True})  # k: copies per token
    expected: int = dataclasses.field(metadata={"static": True})  # the copies expected to be kept, by which the
    # kernels' plans are sized: all N * k, or under expert parallelism the share routed to these experts


RANKED_UP_TO = 2048  # copies up to which the sort and the group sizes are comparisons of every pair (a few fused
# reductions instead of a sort and scatters: fewer kernels at a decode step's few copies)


def prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive prefix sums of a short int32 vector [n], as one masked [n, n] sum (XLA's cumsum is a
    reduce_window kernel several times slower at a few hundred elements)."""
    i = jnp.arange(x.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], x[None, :], 0), axis=1, dtype=jnp.int32)


def kept_copies(experts: jax.Array, num_experts: int) -> jax.Array:
    """Whether each copy's expert id is one of [0, E) (outside: another shard's expert, dropped); experts' shape."""
    return (experts >= 0) & (experts < num_experts)


def route(experts: jax.Array, weights: jax.Array, num_experts: int, routed_experts: int | None = None) -> Routing:
    """experts [N, k] int32 ids, weights [N, k] float32 -> the copies sorted by expert. `routed_experts`: the
    experts the ids were chosen among where these are only some of them (expert parallelism: the ids of other
    shards' experts are dropped here), so that about N * k * E / routed_experts copies are expected to be kept."""
    top_k = experts.shape[1]
    kept = kept_copies(experts, num_experts)
    flat = jnp.where(kept, experts, num_experts).reshape(-1)
    copies = jnp.arange(flat.shape[0], dtype=jnp.int32)
    if flat.shape[0] <= RANKED_UP_TO:  # each copy's place: the copies before it in (expert, copy) order
        before = (flat[None, :] < flat[:, None]) | (
            (flat[None, :] == flat[:, None]) & (copies[None, :] < copies[:, None])
        )
        position = jnp.sum(before, axis=1, dtype=jnp.int32)
        order = jnp.sum(jnp.where(position[None, :] == copies[:, None], copies[None, :], 0), axis=1, dtype=jnp.int32)
        group_sizes = jnp.sum(flat[None, :] == jnp.arange(num_experts)[:, None], axis=1, dtype=jnp.int32)
    else:
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        position = jnp.zeros_like(order).at[order].set(copies)
        group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return Routing(
        order=order,
        position=position,
        token_of=order // top_k,
        weight_of=jnp.where(kept, weights, 0.0).reshape(-1)[order].astype(jnp.float32),
        kept=kept.reshape(-1)[order],
        group_sizes=group_sizes,
        top_k=top_k,
        expected=flat.shape[0] if routed_experts is None else -(-flat.shape[0] * num_experts // routed_experts),
    )


def group_offsets(routing: Routing) -> jax.Array:
    """[E + 1] int32: expert e's copies are sorted rows offsets[e] ... offsets[e + 1] - 1."""
    return jnp.concatenate([jnp.zeros(1, jnp.int32), prefix_sum(routing.group_sizes)])


def combine(
    rows: jax.Array, routing: Routing, num_tokens: int, out_dtype: jnp.dtype, row_of: jax.Array | None = None
) -> jax.Array:
    """sum_j w[n, j] * rows[copy (n, j)] in fp32, j = 0 ... k - 1 in order, rounded once to out_dtype: [N, H] from
    the sorted copies' expert outputs rows [R, H], sorted copy i in row i (or row_of[i], [N * k] int32). Each
    token gathers its own copies, in one gather (no scatter-add, whose order of additions a GPU does not fix: the
    same inputs give the same bits). A dropped copy's row is never read (whatever it holds, even NaN)."""
    top_k = routing.top_k
    source = routing.position if row_of is None else composed_indices(row_of, routing.position)
    rows = rows[source].reshape(num_tokens, top_k, rows.shape[-1])
    weights = routing.weight_of[routing.position].reshape(num_tokens, top_k)
    kept = routing.kept[routing.position].reshape(num_tokens, top_k)
    return weighted_sum(rows, weights, kept, out_dtype)


def composed_indices(table: jax.Array, indices: jax.Array) -> jax.Array:
    """table[indices] as an array of its own, for indexing rows: left to fuse into the gather of the rows, XLA
    recomputes the composition (and whatever derives the table) for every element of every row it reads."""
    return jax.lax.optimization_barrier(table[indices])


def weighted_sum(rows: jax.Array, weights: jax.Array, kept: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """sum_j w[n, j] * rows[n, j] over the kept copies, in fp32, j = 0 ... k - 1 in order, rounded once to
    out_dtype: [N, H] from each token's copies' rows [N, k, H], weights [N, k] and kept [N, k] (a dropped copy's
    row adds nothing, whatever it holds)."""
    rows, weights = rows.astype(jnp.float32), weights.astype(jnp.float32)
    out = jnp.zeros((rows.shape[0], rows.shape[-1]), jnp.float32)
    for j in range(rows.shape[1]):
        out = out + jnp.where(kept[:, j, None], rows[:, j] * weights[:, j, None], 0.0)
    return round_to(out, out_dtype)


def group_of(ends: jax.Array, positions: jax.Array) -> jax.Array:
    """int32 index of the group holding each position, for groups ending (exclusive) at the sorted `ends`
    (len(ends) past the last). Compares every pair: the ends are few, and a binary search is a loop of small
    kernels on a GPU."""
    return jnp.searchsorted(ends, positions, side="right", method="compare_all").astype(jnp.int32)


def visits(offsets: jax.Array, tm: int, count: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(expert [V], tile [V], number of real visits [1]) for the (tile, expert) pairs that share rows, in
    expert order, padded to the static bound V = `count` by repeating the last real visit."""
    sizes = offsets[1:] - offsets[:-1]
    first, last = offsets[:-1] // tm, (offsets[1:] - 1) // tm
    per_expert = jnp.where(sizes > 0, last - first + 1, 0)
    ends = prefix_sum(per_expert)
    real = ends[-1]
    v = jnp.minimum(jnp.arange(count), jnp.maximum(real - 1, 0))  # padding visits repeat the last real one
    expert = jnp.minimum(group_of(ends, v), sizes.shape[0] - 1)
    tile = (first[expert] + v - (ends[expert] - per_expert[expert])).astype(jnp.int32)
    return expert, jnp.where(real > 0, tile, 0), real.reshape(1).astype(jnp.int32)


def placed_copies(routing: Routing, starts: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """The sorted copies laid out with expert e's group from row starts[e]: each sorted copy's row [N * k] (dropped
    copies after the last group's, within the `rows`) and the sorted copy in each of the rows [R] (0 in rows of
    none), both int32."""
    offsets = group_offsets(routing)
    copy = jnp.arange(routing.order.shape[0], dtype=jnp.int32)
    copy_expert = jnp.minimum(group_of(offsets[1:], copy), routing.group_sizes.shape[0] - 1)
    row_of = starts[copy_expert] + copy - offsets[copy_expert]
    return row_of, jnp.zeros(rows, jnp.int32).at[row_of].set(copy)
