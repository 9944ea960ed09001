"""Pure-jnp oracle of the ragged paged relative-bias attention: every layer's attention in one engine step.

Each sequence s brings query_lens[s] queries (1 when decoding, up to the chunk when prefilling, γ + 1
in a speculative verify pass; 0 when idle) laid out [S, C] and padded to C. They sit at the positions
kv_lens[s] - query_lens[s] ... kv_lens[s] - 1, and their own K/V are already in the cache, so query i
of s sees the keys at positions p <= kv_lens[s] - query_lens[s] + i (and, with a window w, only those
with position > its own - w). Keys live either in the full-attention page pool, found through the
sequence's page table (`paged`), or in the sliding layers' per-sequence ring, where position p sits at
slot p % R (`ring`). logit = scale <q, k> + bias, bias = (r_q . P)[distance] for 0 <= distance < extent
and 0 beyond; a per-token, per-head sink logit joins the softmax and carries no value; GQA reads KV head
h // (Hq / Hkv). Padding queries give zeros. Arithmetic is `relative_attention`'s, the model's oracle.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.relative_attention.reference import relative_attention


def query_positions(kv_lens: jax.Array, query_lens: jax.Array, width: int) -> jax.Array:
    """[S, C] int32 absolute positions of the step's queries (padding continues past the last one)."""
    return (kv_lens - query_lens)[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]


def paged_keys(pages: jax.Array, page_table: jax.Array) -> tuple[jax.Array, jax.Array]:
    """pages [P, Hkv, page, D], page_table [S, max pages] -> each sequence's keys in position order
    [S, max pages * page, Hkv, D] and their positions [S, max pages * page]."""
    view = jnp.swapaxes(pages[page_table], 2, 3)  # [S, max pages, page, Hkv, D]
    slots, num_pages, page_size = view.shape[:3]
    positions = jnp.broadcast_to(jnp.arange(num_pages * page_size, dtype=jnp.int32), (slots, num_pages * page_size))
    return view.reshape(slots, num_pages * page_size, *view.shape[3:]), positions


def ring_positions(size: int, kv_lens: jax.Array) -> jax.Array:
    """[S, R]: the position each ring slot holds once kv_lens[s] tokens are in it (slots never written:
    far in the future, so no query sees them)."""
    last = kv_lens - 1
    held = last[:, None] - (last[:, None] - jnp.arange(size, dtype=jnp.int32)[None, :]) % size
    return jnp.where(held >= 0, held, jnp.iinfo(jnp.int32).max // 2)


def sequence_rings(ring_rows: jax.Array | None, slots: int) -> jax.Array:
    """[S] int32: the ring each sequence reads (None: sequence s reads ring s)."""
    return jnp.arange(slots, dtype=jnp.int32) if ring_rows is None else jnp.asarray(ring_rows, jnp.int32)


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    rel: jax.Array,
    rel_proj: jax.Array,
    sinks: jax.Array,
    *,
    page_table: jax.Array | None,
    scale: float,
    window: int | None,
    ring_rows: jax.Array | None = None,
) -> jax.Array:
    """Attention output [S, C, Hq, D] in q's dtype (zeros at padding queries).

    q [S, C, Hq, D] (clipped and tau-scaled by the caller); with a page_table [S, max pages]: k, v the
    page pool [P, Hkv, page, D]; without one: k, v rings [N, Hkv, R, D] (head-major, so that a
    kernel reads one head's page or ring slice as one contiguous block), sequence s's at ring_rows[s] (int32 [S];
    None: s): several layers' rings stacked [layers * slots, ...] are read in place, where slicing one out would
    copy, and sequences that are parts of one slot's chunk read that slot's ring.
    kv_lens [S], query_lens [S] int32 (query_lens <= C, kv_lens >= query_lens); rel [S, C, Hq, d_rel];
    rel_proj [d_rel, extent]; sinks [S, C, Hq]; window: keys closer than this, or None for all.
    """
    positions = query_positions(kv_lens, query_lens, q.shape[1])
    if page_table is not None:
        (k, kv_positions), (v, _) = paged_keys(k, page_table), paged_keys(v, page_table)
    else:
        rows = sequence_rings(ring_rows, q.shape[0])
        k, v = (jnp.swapaxes(x[rows], 1, 2) for x in (k, v))
        kv_positions = ring_positions(k.shape[1], kv_lens)
    out = relative_attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        rel,
        rel_proj,
        sinks,
        positions,
        kv_positions,
        scale=scale,
        window=window,
    )
    real = jnp.arange(q.shape[1])[None, :] < query_lens[:, None]
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))
