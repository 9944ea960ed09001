"""Mosaic TPU kernel of the ragged paged relative-bias attention.

Grid (sequence, KV head, block step): each program holds one sequence's rows for one KV head (the G query
heads that read it, at every step position) and walks that sequence's KV blocks lo .. hi - 1, one page
(or ring slice) per step, with an online softmax in VMEM. The page of each step comes from the page
table through scalar prefetch; steps past hi map to the block already loaded, so Pallas fetches
nothing for them, and their compute is skipped: windowed layers never read pages left of the window
and short sequences never read past their end. The bias comes in the frame of the blocks
(`blocks.frame_bias`), fetched only for blocks within the extent.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention.blocks import Plan, attend


def _rounded(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """fp32 x rounded to the activation dtype and back (the reference rounds scores there)."""
    return x if dtype == jnp.float32 else x.astype(dtype).astype(jnp.float32)


def _key_positions(block: jax.Array, kv_len: jax.Array, shape: tuple[int, int], ring: int | None) -> jax.Array:
    """[R, B] positions of the keys in logical block `block` (ring slots never written: past every query)."""
    slot = block * shape[1] + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    if ring is None:
        return slot
    last = kv_len - 1
    held = last - jax.lax.rem(last - slot + ring, ring)
    return jnp.where(held >= 0, held, jnp.iinfo(jnp.int32).max // 2)


def _attend_block(
    kv_lens_ref, query_lens_ref, lo_ref, hi_ref, bias_first_ref, *refs,
    scale: float, window: int | None, width: int, steps: int, frame_blocks: int, ring: int | None, paged: bool,
) -> None:  # fmt: skip
    if paged:
        refs = refs[1:]  # the page table is only read by the index maps
    q_ref, k_ref, v_ref, bias_ref, sinks_ref, out_ref, m_ref, l_ref, acc_ref = refs
    s, step = pl.program_id(0), pl.program_id(2)

    @pl.when(step == 0)
    def _():
        m_ref[...] = sinks_ref[...]  # the sink joins the softmax: it starts the running max, with weight 1
        l_ref[...] = jnp.ones_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    block = lo_ref[s] + step

    @pl.when(block < hi_ref[s])
    def _():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]  # [R, D], [B, D], [B, D]
        dtype = q.dtype
        scores = jax.lax.dot_general(q, k.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        scores = _rounded(scores * scale, dtype)  # [R, B]
        framed = block - bias_first_ref[s]
        in_frame = (framed >= 0) & (framed < frame_blocks)
        scores = jnp.where(in_frame, _rounded(scores + bias_ref[...].astype(jnp.float32), dtype), scores)

        kv_len = kv_lens_ref[s]
        rows = jax.lax.broadcasted_iota(jnp.int32, scores.shape, 0)
        query_pos = kv_len - query_lens_ref[s] + jax.lax.rem(rows, width)
        distance = query_pos - _key_positions(block, kv_len, scores.shape, ring)
        visible = distance >= 0
        if window is not None:
            visible &= distance < window
        scores = jnp.where(visible, scores, -jnp.inf)

        m_prev = m_ref[...]  # [R, 1]
        m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
        weights = jnp.exp(scores - m_next)
        decay = jnp.exp(m_prev - m_next)
        l_ref[...] = decay * l_ref[...] + weights.sum(axis=1, keepdims=True)
        acc_ref[...] = decay * acc_ref[...] + jax.lax.dot_general(
            weights.astype(dtype), v.astype(dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        m_ref[...] = m_next

    @pl.when(step == steps - 1)
    def _():
        out_ref[...] = (acc_ref[...] / l_ref[...]).astype(out_ref.dtype)


def kernel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    sinks: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    page_table: jax.Array | None,
    plan: Plan,
    *,
    scale: float,
    window: int | None,
    width: int,
) -> jax.Array:
    """`blocks.attend`'s kernel on TPU: q [S, Hkv, R, D] -> [S, Hkv, R, D]."""
    slots, kv_heads, rows, head_dim = q.shape
    block, paged = plan.block, page_table is not None
    squeezed = pl.Squeezed()

    def visited(s, step, lo, hi):  # the logical block of this step, held at the last one past hi
        return jnp.maximum(jnp.minimum(lo[s] + step, hi[s] - 1), 0)

    if paged:
        max_pages = page_table.shape[1]

        def kv_index(s, h, step, kv_lens, query_lens, lo, hi, bias_first, table):
            return table[s * max_pages + jnp.minimum(visited(s, step, lo, hi), max_pages - 1)], h, 0, 0
    else:

        def kv_index(s, h, step, kv_lens, query_lens, lo, hi, bias_first):
            return s, h, visited(s, step, lo, hi), 0

    def bias_index(s, h, step, kv_lens, query_lens, lo, hi, bias_first, *table):
        framed = visited(s, step, lo, hi) - bias_first[s]
        return s, h, 0, jnp.clip(framed, 0, plan.frame_blocks - 1)

    def row_index(s, h, step, *scalars):
        return s, h, 0, 0

    rows_spec = pl.BlockSpec((squeezed, squeezed, rows, head_dim), row_index)
    kv_spec = pl.BlockSpec((squeezed, squeezed, block, head_dim), kv_index)
    scalars = [kv_lens, query_lens, plan.lo, plan.hi, plan.bias_first]
    if paged:
        scalars.append(page_table.reshape(-1))
    body = functools.partial(
        _attend_block, scale=scale, window=window, width=width, steps=plan.steps, frame_blocks=plan.frame_blocks,
        ring=None if paged else k.shape[2], paged=paged,
    )  # fmt: skip
    return pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(slots, kv_heads, plan.steps),
            in_specs=[
                rows_spec,
                kv_spec,
                kv_spec,
                pl.BlockSpec((squeezed, squeezed, rows, block), bias_index),
                pl.BlockSpec((squeezed, squeezed, rows, 1), row_index),
            ],
            out_specs=rows_spec,
            scratch_shapes=[
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, 1), jnp.float32),
                pltpu.VMEM((rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(*scalars, q, k, v, bias, sinks[..., None])


ragged_paged_attention = functools.partial(attend, kernel)
