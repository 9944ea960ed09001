"""The attention-residual mix and the RMSNorm after it in one Mosaic GPU kernel for Hopper (sm90).

A CTA takes one token, with two warpgroups that split its H columns in halves. Each copies its half of the
token's row of every source and of the partial into SMEM (TMA bulk copies in up to three parts of its columns, a
barrier each, so the first sweep starts on the first part), and from then on reads SMEM only. The arithmetic is
fp32 in registers, CHUNK columns at a time (each thread V contiguous values of every row: `ROWS`), in three sweeps
over the rows in SMEM, each unrolled so that a step's loads issue ahead of the sums before it:
(1) each row's sum of squares and its dot with each query (the queries, [Q, H] fp32, read from GMEM through L2),
accumulated per column, then summed over the columns (one batched cross-warp reduction) and over the two
warpgroups (through SMEM); the softmax over the N + 1 sources per query on those scalars, folded with each
source's 1 / rms into one coefficient per (query, source);
(2) each query's mix, sum_s coef * row_s, kept in registers (a thread holds H / 256 values of it), and its sum of
squares (the final RMSNorm's, summed likewise);
(3) the kept mixes times that RMSNorm's 1 / rms and its gain, rounded once to the output dtype and stored
straight from registers into the output row.
HBM traffic is the sources read once and the Q outputs written once (the XLA formulation reads them several
times: bench/results/README.md).

One token per CTA keeps every sum over H inside the CTA, with no tile that straddles the token count, and at
the production shape (8 bf16 blocks + the fp32 partial at H = 4608: 92 KB of SMEM) leaves room for two CTAs per
SM, so one's copies land while the other computes; two warpgroups per token give each SM 16 warps to hide the
latencies of a sweep. Mosaic GPU's cross-warp reductions share one SMEM scratch for the whole CTA, so the two
warpgroups take turns through it. Sums run in another order than the oracle's: equal up to fp32 rounding.

A stacked buffer of sources [N, ..., H] is one operand, its rows copied alike. With a count `valid` of real
sources (an int32 in GMEM, loaded as a scalar), a masked source's row is not copied (its warpgroup arrives on the
copies' barrier without one), and every load of its SMEM row, which holds whatever was there, is selected to 0
and its logits to -inf: softmax weight exactly 0, nothing of it in the sums.
"""

import functools
import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import devices
from pallas_kernels.attn_res.reference import SOURCE_EPS, Sources, mask_sources, source_specs

V = 2  # contiguous values per thread in a row's chunk
CHUNK = 128 * V  # columns per step: a warpgroup's 128 threads side by side
# [R, CHUNK]: thread t holds columns V t ... V t + V - 1 of every row, so sums over rows stay in its registers
ROWS = plgpu.Layout.TILED(
    plgpu.Tiling(((1, CHUNK), (CHUNK // 4,), (V,))), warp_dims=(-3,), lane_dims=(-2,), vector_dim=-1
)
COLUMNS = ROWS.reduce(0)  # [CHUNK]: one row of ROWS
PER_ROW = ROWS.reduce(1)  # [R]: one value per row, in every thread
WARPGROUPS = 2  # per CTA, each over H / 2 columns of the token
# rows summed over the columns per cross-warp round (512 bytes of SMEM scratch each; each round costs two warpgroup
# barriers): every production call's (1 + Q)(N + 1) sums fit one round
REDUCTION_ROWS = 36
LANDINGS = 3  # a warpgroup's row copies land in up to this many parts of whole chunks, a barrier each


def _landings(hidden: int) -> list[range]:
    """The chunks of a warpgroup's columns in the order their copies land: up to LANDINGS parts, a barrier each, so
    the first sweep starts on the first part while the rest are in flight."""
    steps = hidden // WARPGROUPS // CHUNK
    parts = min(LANDINGS, steps)
    bounds = [steps * p // parts for p in range(parts + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def _load_gmem(ref) -> jax.Array:
    """A [CHUNK] slice of a GMEM row in registers (COLUMNS; through L2: every CTA reads the same queries)."""
    return plgpu.load(ref, layout=COLUMNS, optimized=False)  # "optimized" transfers are SMEM's only


def _rows(values: jax.Array, count: int) -> jax.Array:
    """[CHUNK] -> [count, CHUNK]: the same values in every row."""
    return plgpu.layout_cast(lax.broadcast_in_dim(values, (count, CHUNK), (1,)), ROWS)


def _columns(values: jax.Array) -> jax.Array:
    """[R] -> [R, CHUNK]: each row's value in every column."""
    return plgpu.layout_cast(lax.broadcast_in_dim(values, (values.shape[0], CHUNK), (0,)), ROWS)


def _source_rows(refs) -> list:
    """The sources' GMEM refs [M, H], one per source: each listed operand, and each entry of a stacked one."""
    rows = []
    for ref in refs:
        rows += [ref] if len(ref.shape) == 2 else [ref.at[s] for s in range(ref.shape[0])]
    return rows


def _mix_and_norm(*refs, operands: int, masked: bool, num_queries: int, hidden: int, eps: float):
    """One token: refs = the count of real sources [1] int32 if masked, the sources' operands ([M, H] each, or one
    stacked [N, M, H]) and the partial [M, H] (GMEM), queries [Q, H] fp32, gains [Q, H], out [Q, M, H]; then
    N + 1 SMEM rows [1, H], the exchanges [W, (1 + Q) (N + 1)] and [W, max(2, Q)] fp32, and the barriers (each
    warpgroup's copies landed; each warpgroup's turn at the two exchanges)."""
    inputs = masked + operands + 1
    valid = refs[0][0] if masked else None
    row_refs = [*_source_rows(refs[masked : inputs - 1]), refs[inputs - 1]]
    count = len(row_refs)
    query_ref, gain_ref, out_ref = refs[inputs : inputs + 3]
    smem, (scores_smem, squares_smem, landed, score_turns, square_turns) = refs[inputs + 3 :][:count], refs[-5:]
    token, wg = lax.axis_index("token"), lax.axis_index("wg")
    share = hidden // WARPGROUPS
    landings = _landings(hidden)
    steps = share // CHUNK  # the sweeps run unrolled: each step's loads issue ahead of the sums before them

    def columns(i: int, width: int = 1) -> pl.Slice:
        return pl.ds(pl.multiple_of(wg * share + i * CHUNK, CHUNK), width * CHUNK)

    def landed_at(part: int):
        return landed.at[wg * len(landings) + part]

    for part, chunks in enumerate(landings):
        span = columns(chunks.start, len(chunks))
        for s, (row_ref, row_smem) in enumerate(zip(row_refs, smem, strict=True)):
            copy = functools.partial(
                plgpu.copy_gmem_to_smem,
                row_ref.at[pl.ds(token, 1), span],
                row_smem.at[:, span],
                landed_at(part),
                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,
            )
            if valid is None or s == count - 1:
                copy()
            else:  # a masked source's row is not read: its warpgroup arrives without a copy
                pl.when(s < valid)(copy)
                pl.when(s >= valid)(functools.partial(plgpu.barrier_arrive, landed_at(part)))

    def chunk(i: int) -> jax.Array:  # [count, CHUNK] fp32
        rows = [plgpu.load(row.at[:, columns(i)], layout=ROWS).astype(jnp.float32) for row in smem]
        return jnp.concatenate(mask_sources(rows, valid, 0.0), axis=0)

    def fetch(ref, i: int) -> list[jax.Array]:  # Q x [CHUNK] fp32 of a [Q, H] GMEM ref
        return [_load_gmem(ref.at[q, columns(i)]).astype(jnp.float32) for q in range(num_queries)]

    def added(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(x + y for x, y in zip(a, b, strict=True))

    queries = [fetch(query_ref, i) for i in range(steps)]  # issued before any wait: no sweep waits on L2
    firsts = {chunks.start: part for part, chunks in enumerate(landings)}

    def scores(i: int) -> tuple[jax.Array, ...]:  # [count, CHUNK] each: squares, then each query's products
        if i in firsts:
            plgpu.barrier_wait(landed_at(firsts[i]))
        x = chunk(i)
        return (x * x, *(x * _rows(q, count) for q in queries[i]))

    sums = functools.reduce(added, map(scores, range(steps)))
    totals = _summed(jnp.concatenate(sums, axis=0), scores_smem, score_turns, wg)  # squares, then each q's dots
    inverse_rms = lax.rsqrt(totals[:count] / hidden + SOURCE_EPS)  # [count]
    coefs = []  # Q x [count]: softmax weight / rms of each source
    for q in range(num_queries):
        logits = totals[(1 + q) * count : (2 + q) * count] * inverse_rms * hidden**-0.5
        logits = mask_sources([logits[s : s + 1] for s in range(count)], valid, -jnp.inf)
        top = functools.reduce(jnp.maximum, logits)
        weights = [jnp.exp(x - top) for x in logits]
        total = functools.reduce(jnp.add, weights)
        coefs.append(jnp.concatenate([w / total * inverse_rms[s : s + 1] for s, w in enumerate(weights)], axis=0))

    def mixes(i: int) -> tuple[jax.Array, ...]:  # Q x [1, CHUNK]: sum_s coef[s] row_s, kept in registers
        x = chunk(i)
        return tuple(_rows(jnp.sum(x * _columns(c), axis=0), 1) for c in coefs)

    mixed = [mixes(i) for i in range(steps)]
    squares = functools.reduce(added, ([m * m for m in step] for step in mixed))
    gains = [fetch(gain_ref, i) for i in range(steps)]  # in flight during the sum below
    squares = _summed(jnp.concatenate(squares, axis=0), squares_smem, square_turns, wg)  # [Q]
    final_inverse_rms = lax.rsqrt(squares / hidden + eps)  # [Q]: the final RMSNorm's 1 / rms
    scales = [_columns(final_inverse_rms[q : q + 1]) for q in range(num_queries)]
    for i, step in enumerate(mixed):
        for q, (gain, mix) in enumerate(zip(gains[i], step, strict=True)):
            normed = _rows(gain, 1) * (mix * scales[q])
            out_ref.at[q, pl.ds(token, 1), columns(i)][...] = normed.astype(out_ref.dtype)


def _summed(partials: jax.Array, exchange, turns, wg: jax.Array) -> jax.Array:
    """[R, CHUNK] per-column partial sums of this warpgroup -> [R]: the sums over both warpgroups' columns. The
    warpgroups take turns (the cross-warp reduction's SMEM scratch is the CTA's), each leaving its sums in
    exchange [W, R] and arriving on its turn's barrier."""
    rows = partials.shape[0]
    if rows == 1:  # Mosaic GPU stores no one-element array of this layout: a second row, dropped
        partials = jnp.concatenate([partials, partials], axis=0)

    def turn(w: int) -> None:
        if w:
            plgpu.barrier_wait(turns.at[w - 1])
        exchange.at[w][...] = jnp.sum(partials, axis=1)
        plgpu.barrier_arrive(turns.at[w])

    for w in range(WARPGROUPS):
        pl.when(wg == w)(functools.partial(turn, w))
    plgpu.barrier_wait(turns.at[WARPGROUPS - 1])
    sums = [plgpu.load(exchange.at[w], layout=PER_ROW) for w in range(WARPGROUPS)]
    return functools.reduce(jnp.add, sums)[:rows]


def check(sources: Sources, partial: jax.Array, queries: jax.Array, norm_weights: jax.Array) -> None:
    """Raise ValueError (naming what) unless the kernel takes these operands (sources listed or stacked)."""
    sources, hidden = source_specs(sources), partial.shape[-1]
    if any(x.shape != partial.shape for x in sources):
        raise ValueError(f"sources {[x.shape for x in sources]} must have the partial's shape {partial.shape}")
    if queries.ndim != 2 or queries.shape[1] != hidden or norm_weights.shape != queries.shape:
        raise ValueError(f"queries {queries.shape} and norm_weights {norm_weights.shape} must be [Q, {hidden}]")
    if hidden % (WARPGROUPS * CHUNK):
        raise ValueError(
            f"the GPU attention-residual kernel needs H ({hidden}) to be a multiple of {WARPGROUPS * CHUNK}"
        )
    count, num_queries = len(sources) + 1, queries.shape[0]
    barriers = 8 * WARPGROUPS * (2 + len(_landings(hidden)))
    exchanges = 4 * WARPGROUPS * ((1 + num_queries) * count + max(2, num_queries)) + barriers
    smem = hidden * sum(x.dtype.itemsize for x in (*sources, partial))
    limit = devices.gpu().smem_bytes
    if smem + REDUCTION_ROWS * 512 + exchanges > limit:
        raise ValueError(
            f"the GPU attention-residual kernel holds a token's {len(sources)} sources and partial in SMEM:"
            f" {smem} bytes at H = {hidden} exceed {limit}"
        )


def _operands(sources: Sources, hidden: int) -> list[jax.Array]:
    """The sources as kernel operands: each listed one [M, H], or the stacked buffer once [N, M, H] (none if
    N = 0)."""
    if isinstance(sources, Sequence):
        return [x.reshape(-1, hidden) for x in sources]
    return [sources.reshape(sources.shape[0], -1, hidden)] if sources.shape[0] else []


def attn_res_norm(
    sources: Sources,
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
    valid: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """`reference.attn_res_norm`'s contract ([Q, ..., H] from sources[:valid] and the partial [..., H]);
    `interpret`: run in Mosaic GPU's interpreter."""
    check(sources, partial, queries, norm_weights)
    lead, hidden = partial.shape[:-1], partial.shape[-1]
    operands, dtypes = _operands(sources, hidden), [x.dtype for x in (*source_specs(sources), partial)]
    tokens, count, num_queries = math.prod(lead), len(dtypes), queries.shape[0]
    if tokens == 0:
        return jnp.zeros((num_queries, *lead, hidden), out_dtype)
    counts = [] if valid is None else [jnp.asarray(valid, jnp.int32).reshape(1)]
    kernel = functools.partial(
        _mix_and_norm, operands=len(operands), masked=bool(counts), num_queries=num_queries, hidden=hidden, eps=eps
    )
    out = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_queries, tokens, hidden), out_dtype),
        grid=(tokens,),
        grid_names=("token",),
        num_threads=WARPGROUPS,
        thread_name="wg",
        kernel_name="attn_res_norm",
        scratch_types=[
            *(plgpu.SMEM((1, hidden), dtype) for dtype in dtypes),
            plgpu.SMEM((WARPGROUPS, (1 + num_queries) * count), jnp.float32),
            plgpu.SMEM((WARPGROUPS, max(2, num_queries)), jnp.float32),
            plgpu.Barrier(num_arrivals=count, num_barriers=WARPGROUPS * len(_landings(hidden))),
            plgpu.Barrier(num_barriers=WARPGROUPS),
            plgpu.Barrier(num_barriers=WARPGROUPS),
        ],
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane,
            reduction_scratch_bytes=min(REDUCTION_ROWS, (1 + num_queries) * count) * 512,
            # threads write only the output and the exchanges (once, ordered by the turns' barriers); TMA the rows
            unsafe_no_auto_barriers=True,
        ),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(*counts, *operands, partial.reshape(-1, hidden), queries.astype(jnp.float32), norm_weights)
    return out.reshape(num_queries, *lead, hidden)
