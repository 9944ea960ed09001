"""The attention-residual mix + RMSNorm written for XLA's GPU fusions (what runs on GPU until a Mosaic GPU
kernel does): the same fp32 math as the oracle, source by source.

The oracle stacks the N + 1 sources into one fp32 array and scores and mixes them with two fp32 einsums, which
on GPU become a materialised [..., N + 1, H] copy and batched GEMMs with tiny inner sizes (a small fraction of
copy bandwidth: bench/results/README.md). Here each source's sum of squares
and its dots with the queries are sibling reductions over that source alone, the softmax runs on [..., Q, N + 1]
scalars, and the mix is one elementwise pass over the sources, so XLA reads each source a few times and
materialises nothing of their size. Sums run in another order than the oracle's: equal up to fp32 rounding.
A stacked buffer of sources is read source by source alike; a source past the count `valid` has its values and
its scores selected away (0 and -inf) before they meet the others'.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.attn_res.reference import SOURCE_EPS, Sources, mask_sources
from pallas_kernels.numerics import rms_normalize, round_to


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
    rows = mask_sources([x.astype(jnp.float32) for x in (*sources, partial)], valid, 0.0)
    hidden = partial.shape[-1]
    queries = queries.astype(jnp.float32)
    inverse_rms = [jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + SOURCE_EPS) for x in rows]  # (N + 1) x [...]
    scores = [
        jnp.stack([jnp.sum(x * q, axis=-1) for q in queries]) * r * hidden**-0.5  # [Q, ...]
        for x, r in zip(rows, inverse_rms, strict=True)
    ]
    weights = jax.nn.softmax(jnp.stack(mask_sources(scores, valid, -jnp.inf), axis=-1), axis=-1)  # [Q, ..., N + 1]
    gains = norm_weights.astype(jnp.float32)
    out = []
    for q in range(queries.shape[0]):
        mixed = sum(weights[q, ..., s, None] * inverse_rms[s][..., None] * x for s, x in enumerate(rows))
        out.append(gains[q] * rms_normalize(mixed, eps))
    return round_to(jnp.stack(out), out_dtype)
