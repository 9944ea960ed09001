"""Pure-jnp oracle of the attention-residual mix fused with the RMSNorm that follows it.

Block attention residuals (arXiv 2603.15031): each token's closed block representations and the current
block's partial sum are RMS-normalised (no gain, eps 1e-6) and serve as keys and values; a learned query
per mix scores them (scaled by 1/sqrt(H)), a softmax over the sources weighs them, and the mix then goes
through its sublayer's weighted RMSNorm. fp32 throughout, rounded once to the output dtype, as transformers
computes the mix and the RMSNorm one after the other.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import einsum, rms_normalize, round_to

SOURCE_EPS = 1e-6  # the sources' own RMSNorm (no gain)


def mix(sources: Sequence[jax.Array], partial: jax.Array, queries: jax.Array) -> jax.Array:
    """The mixes [Q, ..., H] fp32 of sources (N arrays [..., H]) and partial [..., H] under queries [Q, H]."""
    stacked = rms_normalize(jnp.stack([*sources, partial], axis=-2), SOURCE_EPS)  # [..., N + 1, H]
    hidden = stacked.shape[-1]
    logits = einsum("qh,...sh->...qs", queries.astype(jnp.float32), stacked) * hidden**-0.5
    mixed = einsum("...qs,...sh->...qh", jax.nn.softmax(logits, axis=-1), stacked)  # [..., Q, H]
    return jnp.moveaxis(mixed, -2, 0)


def attn_res_norm(
    sources: Sequence[jax.Array],
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
) -> jax.Array:
    """RMSNorm_q(mix_q) for each query q: [Q, ..., H] in out_dtype.

    sources: the closed blocks' N arrays [..., H] (N >= 0, any float dtype); partial [..., H]; queries [Q, H];
    norm_weights [Q, H]: the gain of the RMSNorm (eps `eps`) that follows mix q.
    """
    mixed = mix(sources, partial, queries)
    gains = norm_weights.astype(jnp.float32).reshape(norm_weights.shape[0], *(1,) * (mixed.ndim - 2), -1)
    return round_to(gains * rms_normalize(mixed, eps), out_dtype)
