"""The attention-residual mix and the RMSNorm after it in one Mosaic TPU kernel.

A grid step takes a tile of tokens: every source's rows and the partial's rows [tokens, H] stream in once
(double-buffered by the pipeline), the queries and norm gains stay resident, and all arithmetic runs in fp32
in VMEM: each source normalised once, its score against each query a lane reduction, the softmax over the N +
1 sources per token and query, the weighted sums, the final RMSNorm, one rounding to the output dtype. HBM
traffic is the sources read once and the Q outputs written once, against several passes for XLA's unfused
version.

A stacked buffer of sources [N, ..., H] is passed once per source (the same buffer, no copy), each with its own
tiles. The count of real sources `valid` comes by scalar prefetch (SMEM): a masked source's index map stays on
its first tile, and a block whose index does not change from one step to the next is not fetched again, so its
rows are read once per core rather than once per tile; in VMEM they are then selected away (values 0, logits
-inf), whatever they hold.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import devices
from pallas_kernels.attn_res.reference import SOURCE_EPS, Sources, mask_sources, source_specs


def _step_vmem() -> int:
    """Bytes of VMEM a grid step's buffers may use: 3/8 of a core's (the compiler may use twice that)."""
    return devices.tpu().vmem_bytes * 3 // 8


def _tokens_per_step(tokens: int, hidden: int, sources: int, queries: int, itemsize: int) -> int:
    """Rows per grid step: a multiple of 8 (the sublane tile) whose buffers fit `_step_vmem`, at most 256."""
    per_token = hidden * (2 * sources * itemsize + sources * 4 + 2 * queries * itemsize + 4 * queries)
    fits = max(8, min(256, _step_vmem() // per_token) // 8 * 8)
    return min(fits, -(-tokens // 8) * 8)


def _tile(source: int, step: jax.Array, prefetch: tuple) -> jax.Array:
    """The tile of tokens that source `source` reads at grid step `step`: the step's own, or the first for a
    source past the prefetched count (an unchanged block index is not fetched again)."""
    if not prefetch:
        return step
    (valid_ref,) = prefetch
    return jnp.where(source < valid_ref[0], step, 0)


def _source_blocks(sources: Sources, tile: int, hidden: int) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """The sources as operands, each with its tiles [tile, H]: a listed source [M, H] its own operand, a stacked
    buffer [N, M, H] once per source."""
    if isinstance(sources, Sequence):
        return [x.reshape(-1, hidden) for x in sources], [
            pl.BlockSpec((tile, hidden), lambda i, *prefetch, s=s: (_tile(s, i, prefetch), 0))
            for s in range(len(sources))
        ]
    stacked = sources.reshape(len(sources), -1, hidden)
    return [stacked] * len(sources), [
        pl.BlockSpec((pl.squeezed, tile, hidden), lambda i, *prefetch, s=s: (s, _tile(s, i, prefetch), 0))
        for s in range(len(sources))
    ]


def _normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis in fp32, summed in the kernel's own order (`numerics.rms_normalize` is the
    model's, whose CPU form is not a kernel's)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def _mix_and_norm(*refs, count: int, eps: float, masked: bool):
    """One tile: refs = the count of real sources [1] (SMEM) if masked, count row refs [T, H] (the sources, then
    the partial), queries [Q, H], gains [Q, H], out [Q, T, H]."""
    valid = refs[0][0] if masked else None
    row_refs, (query_ref, gain_ref, out_ref) = refs[masked : masked + count], refs[masked + count :]
    queries = query_ref[...].astype(jnp.float32)  # [Q, H]
    scale = queries.shape[-1] ** -0.5
    normed = mask_sources([_normalized(ref[...], SOURCE_EPS) for ref in row_refs], valid, 0.0)  # count x [T, H]
    for q in range(queries.shape[0]):
        query = queries[q : q + 1]  # [1, H]
        logits = [jnp.sum(x * query, axis=-1, keepdims=True) * scale for x in normed]  # count x [T, 1]
        logits = mask_sources(logits, valid, -jnp.inf)
        top = functools.reduce(jnp.maximum, logits)
        weights = [jnp.exp(x - top) for x in logits]
        total = functools.reduce(jnp.add, weights)
        mixed = functools.reduce(jnp.add, (w / total * x for w, x in zip(weights, normed, strict=True)))
        out_ref[q] = (gain_ref[q : q + 1].astype(jnp.float32) * _normalized(mixed, eps)).astype(out_ref.dtype)


def attn_res_norm(
    sources: Sources,
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
    valid: jax.Array | None = None,
) -> jax.Array:
    """`reference.attn_res_norm`'s contract ([Q, ..., H] from sources[:valid] and the partial [..., H])."""
    lead, hidden = partial.shape[:-1], partial.shape[-1]
    partial = partial.reshape(-1, hidden)  # [M, H]
    tokens, count, num_queries = partial.shape[0], len(sources) + 1, queries.shape[0]
    itemsize = max(x.dtype.itemsize for x in (*source_specs(sources), partial))
    tile = _tokens_per_step(tokens, hidden, count, num_queries, itemsize)
    operands, specs = _source_blocks(sources, tile, hidden)
    prefetch = [] if valid is None else [jnp.asarray(valid, jnp.int32).reshape(1)]
    whole = pl.BlockSpec((num_queries, hidden), lambda i, *_: (0, 0))
    out = pl.pallas_call(
        functools.partial(_mix_and_norm, count=count, eps=eps, masked=bool(prefetch)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(pl.cdiv(tokens, tile),),
            in_specs=[*specs, pl.BlockSpec((tile, hidden), lambda i, *_: (i, 0)), whole, whole],
            out_specs=pl.BlockSpec((num_queries, tile, hidden), lambda i, *_: (0, i, 0)),
        ),
        out_shape=jax.ShapeDtypeStruct((num_queries, tokens, hidden), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=2 * _step_vmem()),
    )(*prefetch, *operands, partial, queries, norm_weights)
    return out.reshape(num_queries, *lead, hidden)
