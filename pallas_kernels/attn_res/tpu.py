"""The attention-residual mix and the RMSNorm after it in one Mosaic TPU kernel.

A grid step takes a tile of tokens: every source's rows and the partial's rows [tokens, H] stream in once
(double-buffered by the pipeline), the queries and norm gains stay resident, and all arithmetic runs in fp32
in VMEM: each source normalised once, its score against each query a lane reduction, the softmax over the N +
1 sources per token and query, the weighted sums, the final RMSNorm, one rounding to the output dtype. HBM
traffic is the sources read once and the Q outputs written once, against several passes for XLA's unfused
version.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.attn_res.reference import SOURCE_EPS
from pallas_kernels.numerics import rms_normalize

VMEM_BUDGET = 24 << 20  # bytes of VMEM a step may use (v7x: 64 MiB per core)


def _tokens_per_step(tokens: int, hidden: int, sources: int, queries: int, itemsize: int) -> int:
    """Rows per grid step: a multiple of 8 (the sublane tile) whose buffers fit VMEM_BUDGET, at most 256."""
    per_token = hidden * (2 * sources * itemsize + sources * 4 + 2 * queries * itemsize + 4 * queries)
    fits = max(8, min(256, VMEM_BUDGET // per_token) // 8 * 8)
    return min(fits, -(-tokens // 8) * 8)


def _mix_and_norm(*refs, count: int, eps: float):
    """One tile: refs = count source refs [T, H], queries [Q, H], gains [Q, H], out [Q, T, H]."""
    source_refs, (query_ref, gain_ref, out_ref) = refs[:count], refs[count:]
    queries = query_ref[...].astype(jnp.float32)  # [Q, H]
    scale = queries.shape[-1] ** -0.5
    normed = [rms_normalize(ref[...], SOURCE_EPS) for ref in source_refs]  # count x [T, H]
    for q in range(queries.shape[0]):
        query = queries[q : q + 1]  # [1, H]
        logits = [jnp.sum(x * query, axis=-1, keepdims=True) * scale for x in normed]  # count x [T, 1]
        top = functools.reduce(jnp.maximum, logits)
        weights = [jnp.exp(x - top) for x in logits]
        total = functools.reduce(jnp.add, weights)
        mixed = functools.reduce(jnp.add, (w / total * x for w, x in zip(weights, normed, strict=True)))
        out_ref[q] = (gain_ref[q : q + 1].astype(jnp.float32) * rms_normalize(mixed, eps)).astype(out_ref.dtype)


def attn_res_norm(
    sources: Sequence[jax.Array],
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """`reference.attn_res_norm`'s contract ([Q, ..., H] from N sources and the partial [..., H])."""
    lead, hidden = partial.shape[:-1], partial.shape[-1]
    rows = [x.reshape(-1, hidden) for x in (*sources, partial)]  # (N + 1) x [M, H]
    tokens, count, num_queries = rows[0].shape[0], len(rows), queries.shape[0]
    itemsize = max(x.dtype.itemsize for x in rows)
    tile = _tokens_per_step(tokens, hidden, count, num_queries, itemsize)
    row_spec = pl.BlockSpec((tile, hidden), lambda i: (i, 0))
    whole = pl.BlockSpec((num_queries, hidden), lambda i: (0, 0))
    out = pl.pallas_call(
        functools.partial(_mix_and_norm, count=count, eps=eps),
        grid=(pl.cdiv(tokens, tile),),
        in_specs=[row_spec] * count + [whole, whole],
        out_specs=pl.BlockSpec((num_queries, tile, hidden), lambda i: (0, i, 0)),
        out_shape=jax.ShapeDtypeStruct((num_queries, tokens, hidden), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=2 * VMEM_BUDGET),
    )(*rows, queries, norm_weights)
    return out.reshape(num_queries, *lead, hidden)
