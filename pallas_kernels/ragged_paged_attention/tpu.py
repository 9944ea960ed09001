"""Mosaic TPU kernel of the ragged paged relative-bias attention.

Grid (sequence, row tile, step). A program holds one tile of a sequence's query rows for every KV head
and walks the KV blocks that tile can see, `per_step` pages (or ring slices) of all KV heads per step,
with an online softmax in VMEM. Each of the step's pages is its own pipelined operand whose index map
reads the page table (scalar prefetch), so Pallas double-buffers them across steps and sequences; a
step's fetch is large enough (~4 MiB at 8 KV heads) to hide the per-step cost. Pages past a tile's last
visible block map to the block already held, so nothing is fetched or computed for them: windowed layers
never read left of the window, prefill tiles never read right of their causal horizon, short sequences
never read past their end.

The bias is computed in the kernel, only for blocks within the extent: rows whose step positions run
consecutively see a block's keys at distances D + i - t (row i, key t), so their bias is one small
matmul of their relative states with a window of the reversed, zero-padded profile table (VMEM-resident),
sheared by a strided lane rotation (row i rotated by one more than row i - 1).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.numerics import round_through, round_to
from pallas_kernels.ragged_paged_attention.blocks import Plan, attend, on_grouped_rows, visible_blocks

STEP_BYTES = 4 << 20  # K and V bytes fetched per grid step
MAX_PER_STEP = 8  # pages per step (each one pipelined operand of K and of V)
TILE_ROWS = 128  # query rows per program once a chunk is at least this wide


def supports(dtype: jnp.dtype, block: int) -> bool:
    """Whether Mosaic TPU tiles K/V blocks of `block` keys in `dtype`: whole sublane tiles (8 rows of 32-bit
    values, 16 of 16-bit). Rings whose size (window + chunk) has no such divisor up to 128 do not."""
    return block % (32 // jnp.dtype(dtype).itemsize) == 0


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _runs(tile_rows: int, width: int) -> list[tuple[int, int, bool]]:
    """(first row, rows, whether the step position advances by one per row) of a tile's runs of rows whose
    positions are consecutive: the whole tile when it lies in one query head, else one run per query head
    (rows g * C + c); decode rows (C = 1) all share one position."""
    if width == 1:
        return [(0, tile_rows, False)]
    if tile_rows <= width:
        return [(0, tile_rows, True)]
    return [(g * width, width, True) for g in range(tile_rows // width)]


def _block_bias(
    rel: jax.Array, table_ref, distance: jax.Array, *, runs: list, block: int, extent: int, pad: int, span: int
) -> jax.Array:
    """[rows, block] fp32 bias of a block whose key t sits at distance `distance` + i - t from row i of each
    run (+ 0 for runs that do not advance); rel [rows, d_rel]; table_ref [d_rel, pad + extent + span]:
    column u holds the profile at distance extent - 1 + pad - u (zeros outside the extent)."""
    advancing = runs[0][2]
    last_row = runs[0][1] - 1 if advancing else 0
    start = extent - 1 + pad - distance - last_row  # the column row `last_row`, key 0 reads
    aligned = jnp.clip(start // 128 * 128, 0, table_ref.shape[1] - span)
    columns = table_ref[:, pl.ds(pl.multiple_of(aligned, 128), span)]  # [d_rel, span]
    profiles = jax.lax.dot_general(rel, columns, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    profiles = round_through(profiles, rel.dtype)  # [rows, span], as the reference rounds rel . P
    shift = jax.lax.rem(span - (start - aligned + last_row) % span, span)  # row i reads column t + offset - i
    sheared = [
        pltpu.roll(profiles[first : first + count], shift, 1, stride=1, stride_axis=0)
        if advancing
        else pltpu.roll(profiles[first : first + count], shift, 1)
        for first, count, _ in runs
    ]
    return jnp.concatenate(sheared, axis=0)[:, :block] if len(sheared) > 1 else sheared[0][:, :block]


def _tile_blocks(s, tile, kv_lens, query_lens, *, width, tile_rows, block, window, ring):
    """The blocks [lo, hi) the real query rows of `tile` (one query head at consecutive steps) can see."""
    start = (tile * tile_rows) % width
    last = jnp.minimum(start + tile_rows, width) - 1
    return visible_blocks(kv_lens[s], query_lens[s], start, last, block=block, window=window, ring=ring)


def _attend_step(
    kv_lens_ref, query_lens_ref, *refs,
    scale: float, window: int | None, width: int, tile_rows: int, block: int, per_step: int, steps: int,
    extent: int, pad: int, span: int, ring: int | None,
) -> None:  # fmt: skip
    refs = refs[1:]  # the page table or the ring base: only the index maps read it
    q_ref, sinks_ref, rel_ref, table_ref = refs[:4]
    k_refs, v_refs = refs[4 : 4 + per_step], refs[4 + per_step : 4 + 2 * per_step]
    out_ref, m_ref, l_ref, acc_ref = refs[4 + 2 * per_step :]
    s, tile, step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv_len = kv_lens_ref[s]
    first_query = kv_len - query_lens_ref[s]
    lo, hi = _tile_blocks(
        s, tile, kv_lens_ref, query_lens_ref, width=width, tile_rows=tile_rows, block=block, window=window, ring=ring
    )
    first = lo + step * per_step

    @pl.when(step == 0)
    def _():
        m_ref[...] = sinks_ref[...]  # the sink joins the softmax: it starts the running max, with weight 1
        l_ref[...] = jnp.ones_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(first < hi)
    def _():
        rows = q_ref.shape[1]
        shape = (rows, block)
        runs = _runs(rows, width)
        row = tile * tile_rows + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
        query_pos = first_query + jax.lax.rem(row, width)
        run_start = first_query + (tile * tile_rows) % width  # position of each run's first row
        last_row = runs[0][1] - 1 if runs[0][2] else 0
        bias = functools.partial(_block_bias, runs=runs, block=block, extent=extent, pad=pad, span=span)

        def in_band(base):  # does any distance of a block starting at position `base` fall in [0, extent)?
            return (run_start - base + last_row >= 0) & (run_start - base - (block - 1) <= extent - 1)

        visible, biases = [], []  # per page: its visible keys; (block start, where its bias applies) pairs
        for m in range(per_step):
            index = first + m
            slot = index * block + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            if ring is None:
                key_pos, page_biases = slot, [(index * block, in_band(index * block))]
            else:  # ring slot -> the position it holds (two generations around the newest slot)
                newest = jax.lax.rem(kv_len - 1 + ring, ring)
                newer = kv_len - 1 - newest + index * block  # the position slot index * block holds if newer
                held = jnp.where(slot <= newest, newer, newer - ring) + (slot - index * block)
                key_pos = jnp.where(held >= 0, held, jnp.iinfo(jnp.int32).max // 2)
                page_biases = [  # each generation's bias only on its own slots
                    (newer, in_band(newer) & (slot <= newest)),
                    (newer - ring, in_band(newer - ring) & (slot > newest)),
                ]
            distance = query_pos - key_pos
            seen = (distance >= 0) & (index < hi)
            if window is not None:
                seen &= distance < window
            visible.append(seen)
            biases.append(page_biases)

        contract, f32 = (((1,), (0,)), ((), ())), jnp.float32  # [rows, block] x [block, D]
        for h in range(q_ref.shape[0]):
            q, rel = q_ref[h], rel_ref[h]  # [rows, D], [rows, d_rel]
            dtype = q.dtype
            scores = []
            for m in range(per_step):
                k = k_refs[m][h].astype(dtype)  # [block, D]
                logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                logits = round_through(round_through(logits, dtype) * scale, dtype)  # as the reference rounds
                for base, here in biases[m]:
                    biased = round_through(logits + bias(rel, table_ref, run_start - base), dtype)
                    logits = jnp.where(here, biased, logits)
                scores.append(jnp.where(visible[m], logits, -jnp.inf))
            scores = jnp.concatenate(scores, axis=1)  # [rows, per_step * block]
            m_prev = m_ref[h]  # [rows, 1]
            m_next = jnp.maximum(m_prev, scores.max(axis=1, keepdims=True))
            weights = jnp.exp(scores - m_next)
            decay = jnp.exp(m_prev - m_next)
            l_ref[h] = decay * l_ref[h] + weights.sum(axis=1, keepdims=True)
            weights = weights.astype(dtype)
            values = [v_refs[m][h].astype(dtype) for m in range(per_step)]  # [block, D] each
            update = sum(
                jax.lax.dot_general(weights[:, m * block : (m + 1) * block], vm, contract, preferred_element_type=f32)
                for m, vm in enumerate(values)
            )
            acc_ref[h] = decay * acc_ref[h] + update
            m_ref[h] = m_next

    @pl.when(step == steps - 1)
    def _():
        out_ref[...] = (acc_ref[...] / l_ref[...]).astype(out_ref.dtype)


def kernel(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rel: jax.Array,
    rel_proj: jax.Array,
    sinks: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    page_table: jax.Array | None,
    ring_rows: jax.Array,
    plan: Plan,
    *,
    scale: float,
    window: int | None,
    width: int,
) -> jax.Array:
    """The TPU kernel on rows grouped per KV head (`blocks.on_grouped_rows`): q [S, Hkv, R, D] -> [S, Hkv, R, D]."""
    slots, kv_heads, rows, head_dim = q.shape
    block, paged = plan.block, page_table is not None
    tile_rows = TILE_ROWS if width % TILE_ROWS == 0 else rows  # a tile's rows share one query head
    page_bytes = 2 * kv_heads * block * head_dim * k.dtype.itemsize
    per_step = max(1, min(MAX_PER_STEP, plan.steps, STEP_BYTES // page_bytes))
    steps = -(-plan.steps // per_step)
    ring = None if paged else k.shape[2]
    tile_blocks = functools.partial(
        _tile_blocks, width=width, tile_rows=tile_rows, block=block, window=window, ring=ring
    )
    run = _runs(tile_rows, width)[0][1] if width > 1 else 1
    pad, span = _round_up(block + run, 128), _round_up(128 + run + block, 128)
    table = jnp.pad(round_to(rel_proj[:, ::-1], rel.dtype), ((0, 0), (pad, span)))  # [d_rel, pad + extent + span]

    def visited(s, tile, step, m, kv_lens, query_lens):  # logical block of page m, held at the last one seen
        lo, hi = tile_blocks(s, tile, kv_lens, query_lens)
        return jnp.maximum(jnp.minimum(lo + step * per_step + m, hi - 1), 0)

    def kv_index(m):
        if paged:
            max_pages = page_table.shape[1]

            def index(s, tile, step, kv_lens, query_lens, table):
                logical = jnp.minimum(visited(s, tile, step, m, kv_lens, query_lens), max_pages - 1)
                return table[s * max_pages + logical], 0, 0, 0

            return index

        def ring_index(s, tile, step, kv_lens, query_lens, rings):
            return rings[s], 0, visited(s, tile, step, m, kv_lens, query_lens), 0

        return ring_index

    def row_index(s, tile, step, *scalars):
        return s, 0, tile, 0

    squeezed = pl.Squeezed()
    kv_specs = [pl.BlockSpec((squeezed, kv_heads, block, head_dim), kv_index(m)) for m in range(per_step)]
    rows_spec = pl.BlockSpec((squeezed, kv_heads, tile_rows, head_dim), row_index)
    sinks_spec = pl.BlockSpec((squeezed, kv_heads, tile_rows, 1), row_index)
    rel_spec = pl.BlockSpec((squeezed, kv_heads, tile_rows, rel.shape[-1]), row_index)
    table_spec = pl.BlockSpec(table.shape, lambda *_: (0, 0))
    scalars = [kv_lens, query_lens, page_table.reshape(-1) if paged else ring_rows]
    body = functools.partial(
        _attend_step,
        scale=scale,
        window=window,
        width=width,
        tile_rows=tile_rows,
        block=block,
        per_step=per_step,
        steps=steps,
        extent=rel_proj.shape[1],
        pad=pad,
        span=span,
        ring=ring,
    )
    return pl.pallas_call(
        body,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=(slots, rows // tile_rows, steps),
            in_specs=[rows_spec, sinks_spec, rel_spec, table_spec, *kv_specs, *kv_specs],
            out_specs=rows_spec,
            scratch_shapes=[
                pltpu.VMEM((kv_heads, tile_rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, tile_rows, 1), jnp.float32),
                pltpu.VMEM((kv_heads, tile_rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(*scalars, q, sinks[..., None], rel, table, *(k,) * per_step, *(v,) * per_step)


ragged_paged_attention = functools.partial(attend, on_grouped_rows(kernel))
