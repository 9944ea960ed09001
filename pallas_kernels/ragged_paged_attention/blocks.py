"""What the kernels share: query rows grouped by KV head, the KV blocks each sequence visits, and (for the
kernels that read it as an operand) the relative bias laid out in the frame of those blocks.

A kernel works on one sequence s and one KV head at a time. Its rows are the G = Hq / Hkv query heads
that read that KV head, for each of the C step positions (row = g * C + c, query position
kv_lens[s] - query_lens[s] + c). It walks KV blocks of `block` keys: pages of the pool through the page
table (a page is one block), or consecutive slices of the sequence's ring. A tile of rows visits only the
blocks its real queries can see (`visible_blocks`): nothing right of the last one's causal horizon, and on
windowed layers nothing left of the first key the earliest one can see.

The TPU kernel, and the GPU kernel on decode and prefill tiles over the pool, compute the bias themselves
from the relative states and the profile table. The GPU's verify tiles, rings and chunks of other widths
read it as one more operand indexed like the keys, built here (`frame_bias`): for each row, the bias of
each key slot in a frame of `frame_blocks` blocks starting at block `bias_first[s]` (the ring itself for
sliding layers); blocks outside the frame carry no bias (they lie beyond the extent). It costs Hq * C *
frame values per sequence: small for a few queries, the reason prefill builds its bias in the kernel.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import einsum, round_to
from pallas_kernels.ragged_paged_attention.reference import sequence_rings


def group_rows(x: jax.Array, kv_heads: int) -> jax.Array:
    """[S, C, Hq, ...] -> [S, Hkv, G * C, ...] with row g * C + c holding query head kv * G + g at step c."""
    slots, width, heads = x.shape[:3]
    x = x.reshape(slots, width, kv_heads, heads // kv_heads, *x.shape[3:])
    x = jnp.moveaxis(x, 1, 3)  # [S, Hkv, G, C, ...]
    return x.reshape(slots, kv_heads, heads // kv_heads * width, *x.shape[4:])


def ungroup_rows(x: jax.Array, width: int) -> jax.Array:
    """Inverse of `group_rows`: [S, Hkv, G * C, ...] -> [S, C, Hq, ...]."""
    slots, kv_heads, rows = x.shape[:3]
    x = x.reshape(slots, kv_heads, rows // width, width, *x.shape[3:])
    x = jnp.moveaxis(x, 3, 1)  # [S, C, Hkv, G, ...]
    return x.reshape(slots, width, kv_heads * (rows // width), *x.shape[4:])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each sequence's bias frame starts (int32 [S]) and the static sizes a kernel is compiled for."""

    bias_first: jax.Array  # the KV block the bias frame starts at
    block: int = dataclasses.field(metadata={"static": True})  # keys per block
    steps: int = dataclasses.field(metadata={"static": True})  # the most blocks any sequence visits
    frame_blocks: int = dataclasses.field(metadata={"static": True})  # blocks in the bias frame


def ring_block(ring: int, page: int) -> int:
    """The largest block of at most `page` keys that tiles a ring of `ring` slots."""
    return next(b for b in range(min(page, ring), 0, -1) if ring % b == 0)


def kv_block(k: jax.Array, page_table: jax.Array | None) -> int:
    """Keys per block for the pool (its page size) or the rings [S, Hkv, ring, D] (the largest divisor of
    the ring up to 128)."""
    return k.shape[2] if page_table is not None else ring_block(k.shape[2], 128)


def spanned(keys: int, block: int) -> int:
    """The most blocks `keys` consecutive positions can touch, wherever they start."""
    return (keys + block - 2) // block + 1


def visible_blocks(
    kv_lens: jax.Array,
    query_lens: jax.Array,
    c_first: jax.Array | int,
    c_last: jax.Array | int,
    *,
    block: int,
    window: int | None,
    ring: int | None,
) -> tuple[jax.Array, jax.Array]:
    """The KV blocks [lo, hi) that a sequence's queries at steps c_first ... c_last (those below query_lens)
    can see: up to the causal horizon of the last, from the window's edge of the first; on a ring of `ring`
    slots (None: the pool, blocks in position order) every slot written so far. lo == hi == 0 when none of
    them is a real query. Elementwise: arrays, or the scalars a kernel's index map reads."""
    real = c_first < query_lens
    if ring is not None:
        lo = jnp.zeros_like(kv_lens)
        hi = (jnp.minimum(kv_lens, ring) + block - 1) // block
    else:
        first_query = kv_lens - query_lens
        hi = (first_query + jnp.minimum(c_last, query_lens - 1)) // block + 1
        lo = jnp.zeros_like(hi) if window is None else jnp.maximum(first_query + c_first - window + 1, 0) // block
    hi = jnp.where(real, hi, 0)
    return jnp.minimum(lo, hi), hi


def plan_blocks(
    kv_lens: jax.Array,
    query_lens: jax.Array,
    *,
    width: int,
    block: int,
    capacity: int,
    extent: int,
    window: int | None,
    ring: bool,
) -> Plan:
    """The bias frame and the most blocks any sequence visits (`visible_blocks` says which). capacity: key
    slots a sequence can address (max pages * page for the pool, the ring size for rings); width: the step's
    query width C."""
    total = capacity // block
    if ring:  # the ring holds the last `capacity` keys; its frame is the ring
        return Plan(jnp.zeros_like(kv_lens), block=block, steps=total, frame_blocks=total)
    steps = total if window is None else min(total, spanned(width + window - 1, block))
    bias_first = jnp.maximum(kv_lens - query_lens - extent + 1, 0) // block
    frame_blocks = min(total, spanned(width + extent - 1, block))
    return Plan(bias_first, block=block, steps=steps, frame_blocks=frame_blocks)


def banded(profiles: jax.Array, start: jax.Array, frame: int, *, most: int) -> jax.Array:
    """The Toeplitz band [S, H, C, frame] whose (c, f) entry is the profile of row c at distance
    start[s] + c - f (zero outside [0, extent)), from profiles [S, H, C, extent] with distances reversed
    (column t: distance extent - 1 - t); 0 <= start <= most (static).

    No gather: each row is padded, and reading the rows back with a pitch one shorter than written
    shifts row c right by c (a reshape); a per-sequence slice then picks the frame.
    """
    slots, heads, width, extent = profiles.shape
    left, right = max(most - extent + 1, 0), max(frame, width)
    pitch = left + extent + right
    rows = jnp.pad(profiles, ((0, 0), (0, 0), (0, 0), (left, right))).reshape(slots, heads, width * pitch)
    sheared = rows[..., : width * (pitch - 1)].reshape(slots, heads, width, pitch - 1)  # row c shifted by c
    offset = left + extent - 1 - start  # the column of frame position 0
    return jax.vmap(lambda x, o: jax.lax.dynamic_slice_in_dim(x, o, frame, axis=-1))(sheared, offset)


def reversed_profiles(rel: jax.Array, rel_proj: jax.Array) -> jax.Array:
    """Every query row's bias at every distance, [S, Hq, C, extent] in rel's dtype with distances reversed
    (column t: distance extent - 1 - t): the reference's contraction, so that the rounded profiles are its own.
    rel [S, C, Hq, d_rel]; rel_proj [d_rel, extent]."""
    # reversed on the product (which XLA fuses into the band's padding), not on rel_proj (a kernel of its own)
    return einsum("bthr,re->bhte", rel, round_to(rel_proj, rel.dtype))[..., ::-1]


def frame_bias(
    rel: jax.Array,
    rel_proj: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    plan: Plan,
    *,
    kv_heads: int,
    ring: bool,
    profiles: Callable[[jax.Array, jax.Array], jax.Array] = reversed_profiles,
) -> jax.Array:
    """The bias [S, Hkv, R, frame] of every grouped query row at every key slot of its frame, in the
    activation dtype (as the reference rounds it; see `relative_attention.reference.relative_bias`), for
    kernels that read it as an operand. rel [S, C, Hq, d_rel]; rel_proj [d_rel, extent]; `profiles`: the
    products as `reversed_profiles` gives them (a kernel passes its own to sum them as its in-kernel bias does).
    Pool frames are positions bias_first * block onward; a ring's frame is its slots, which hold the last
    `ring` positions rotated (slot p % ring), so its band is built over those positions in order and
    rotated the same way."""
    slots, width, heads, _ = rel.shape
    extent, frame = rel_proj.shape[1], plan.frame_blocks * plan.block
    profiles = profiles(rel, rel_proj)  # [S, Hq, C, extent]
    first_query = kv_lens - query_lens
    if ring:
        oldest = kv_lens - frame  # the position the ring's oldest slot holds once full
        in_order = banded(profiles, first_query - oldest, frame, most=frame)
        rotation = jnp.remainder(-oldest, frame)  # slot i holds in-order position (i - oldest) % frame
        doubled = jnp.concatenate([in_order, in_order], axis=-1)
        bias = jax.vmap(lambda x, r: jax.lax.dynamic_slice_in_dim(x, r, frame, axis=-1))(doubled, rotation)
    else:
        start = first_query - plan.bias_first * plan.block
        bias = banded(profiles, start, frame, most=extent + plan.block - 2)
    return bias.reshape(slots, kv_heads, heads // kv_heads * width, frame)  # head kv * G + g: row g * C + c


Kernel = Callable[..., jax.Array]


def zero_padding(out: jax.Array, query_lens: jax.Array) -> jax.Array:
    """out [S, C, ...] with zeros at each sequence's padding queries (c >= query_lens[s])."""
    real = jnp.arange(out.shape[1])[None, :] < query_lens[:, None]
    return jnp.where(real.reshape(*real.shape, *(1,) * (out.ndim - 2)), out, jnp.zeros((), out.dtype))


def on_grouped_rows(kernel: Kernel) -> Kernel:
    """A kernel of `attend`'s contract from one that works on rows grouped per KV head:

    kernel(q [S, Hkv, R, D], k, v, rel [S, Hkv, R, d_rel], rel_proj, sinks [S, Hkv, R] fp32, kv_lens,
           query_lens, page_table | None, ring_rows, plan, *, scale, window, width) -> [S, Hkv, R, D]
    """

    def grouped(q, k, v, rel, rel_proj, sinks, kv_lens, query_lens, page_table, ring_rows, plan, *, scale, window):
        width, kv_heads = q.shape[1], k.shape[1]
        q, rel, sinks = (group_rows(x, kv_heads) for x in (q, rel, sinks.astype(jnp.float32)))
        out = kernel(
            q, k, v, rel, rel_proj, sinks, kv_lens, query_lens, page_table, ring_rows, plan, scale=scale,
            window=window, width=width,
        )  # fmt: skip
        return zero_padding(ungroup_rows(out, width), query_lens)

    return grouped


def attend(
    kernel: Kernel,
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
    """The reference's signature and result ([S, C, Hq, D], zeros at padding queries) through a kernel
    given the bias frame and the static sizes (`Plan`):

        kernel(q [S, C, Hq, D], k, v, rel [S, C, Hq, d_rel], rel_proj [d_rel, extent], sinks [S, C, Hq],
               kv_lens, query_lens, page_table | None, ring_rows, plan, *, scale, window) -> [S, C, Hq, D]

    with k, v as the reference takes them (pool [P, Hkv, page, D] or rings [N, Hkv, ring, D] read at ring_rows), read
    in whatever dtype the cache keeps, the sink logits in theirs (each one's fp32 value joins the softmax), and zeros at
    padding queries. A kernel lays out the rows (`on_grouped_rows`) and builds the bias (`frame_bias`, or in the
    kernel) as it reads best.
    """
    width = q.shape[1]
    ring, block = page_table is None, kv_block(k, page_table)
    capacity = k.shape[2] if ring else page_table.shape[1] * block
    plan = plan_blocks(
        kv_lens,
        query_lens,
        width=width,
        block=block,
        capacity=capacity,
        extent=rel_proj.shape[1],
        window=window,
        ring=ring,
    )
    return kernel(
        q, k, v, rel, rel_proj, sinks, kv_lens, query_lens, page_table, sequence_rings(ring_rows, q.shape[0]), plan,
        scale=scale, window=window,
    )  # fmt: skip
