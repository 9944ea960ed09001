"""Pure-jnp oracle of the attention-residual mix fused with the RMSNorm that follows it.

Block attention residuals (arXiv 2603.15031): each token's closed block representations and the current
block's partial sum are RMS-normalised (no gain, eps 1e-6) and serve as keys and values; a learned query
per mix scores them (scaled by 1/sqrt(H)), a softmax over the sources weighs them, and the mix then goes
through its sublayer's weighted RMSNorm. fp32 throughout, rounded once to the output dtype, as transformers
computes the mix and the RMSNorm one after the other.

The sources come as a list of N arrays, or as one stacked buffer [N, ..., H] of which only the first `valid` (a
traced count: a scan over the blocks carries a fixed buffer that fills block by block) are real. A source past
the count takes no part: softmax weight exactly 0, and its values selected away (the buffer may hold anything
there, NaN included), so the result is the call on sources[:valid] up to the order of fp32 sums.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import einsum, rms_normalize, round_to, softmax

SOURCE_EPS = 1e-6  # the sources' own RMSNorm (no gain)

Sources = Sequence[jax.Array] | jax.Array  # the closed blocks: N arrays [..., H], or one stacked array [N, ..., H]


def source_specs(sources: Sources) -> list[jax.ShapeDtypeStruct]:
    """Each source's shape [..., H] and dtype, listed or stacked alike."""
    if isinstance(sources, Sequence):
        return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sources]
    return [jax.ShapeDtypeStruct(sources.shape[1:], sources.dtype)] * sources.shape[0]


def mask_sources(values: list[jax.Array], valid: jax.Array | None, fill: float) -> list[jax.Array]:
    """values (one per source, then the partial's) with those of each source s >= valid replaced by `fill`: a
    select, so that nothing of a masked source, NaN or inf included, reaches the result. valid None: all real."""
    if valid is None:
        return values
    *sources, partial = values
    return [*(jnp.where(s < valid, x, fill) for s, x in enumerate(sources)), partial]


def _rows(sources: Sources, partial: jax.Array) -> jax.Array:
    """[..., N + 1, H]: the sources, then the partial, in their common dtype."""
    if isinstance(sources, Sequence):
        return jnp.stack([*sources, partial], axis=-2)
    return jnp.moveaxis(jnp.concatenate([sources, partial[None]]), 0, -2)


def mix(sources: Sources, partial: jax.Array, queries: jax.Array, valid: jax.Array | None = None) -> jax.Array:
    """The mixes [Q, ..., H] fp32 of sources[:valid] (all N if valid is None) and partial [..., H] under queries
    [Q, H]."""
    stacked = rms_normalize(_rows(sources, partial), SOURCE_EPS)  # [..., N + 1, H]
    if valid is not None:  # the sources past the count: values 0 (selected, whatever they hold), logits -inf
        real = jnp.append(jnp.arange(stacked.shape[-2] - 1) < valid, True)  # [N + 1]
        stacked = jnp.where(real[:, None], stacked, 0.0)
    hidden = stacked.shape[-1]
    logits = einsum("qh,...sh->...qs", queries.astype(jnp.float32), stacked) * hidden**-0.5
    if valid is not None:
        logits = jnp.where(real, logits, -jnp.inf)
    mixed = einsum("...qs,...sh->...qh", softmax(logits), stacked)  # [..., Q, H]
    return jnp.moveaxis(mixed, -2, 0)


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
    """RMSNorm_q(mix_q) for each query q: [Q, ..., H] in out_dtype.

    sources: the closed blocks, N arrays [..., H] (N >= 0, any float dtype) or one stacked array [N, ..., H];
    partial [..., H]; queries [Q, H]; norm_weights [Q, H]: the gain of the RMSNorm (eps `eps`) that follows mix q;
    valid: None (all N sources real) or an int32 scalar, possibly traced, 0 <= valid <= N: only sources[:valid]
    and the partial take part (a count outside that range acts as its nearest end).
    """
    mixed = mix(sources, partial, queries, valid)
    gains = norm_weights.astype(jnp.float32).reshape(norm_weights.shape[0], *(1,) * (mixed.ndim - 2), -1)
    return round_to(gains * rms_normalize(mixed, eps), out_dtype)
