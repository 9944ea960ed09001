"""Pure-jnp oracle for Inkling's relative-bias attention.

logit[q, k] = scale * <q, k> + bias[q, k] over keys with 0 <= pos_q - pos_k (< window when sliding),
with bias[q, k] = (rel_q @ rel_proj)[pos_q - pos_k] inside [0, extent) and 0 outside. A per-token,
per-head sink logit joins the softmax (in fp32) and carries no value. Arithmetic follows transformers'
eager path: scores, bias and probabilities are rounded to the activation dtype where it rounds them.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.numerics import einsum, round_to, softmax


def relative_bias(rel: jax.Array, rel_proj: jax.Array, q_positions: jax.Array, kv_positions: jax.Array) -> jax.Array:
    """Bias [B, Hq, T, S] from relative states rel [B, T, Hq, d_rel] and rel_proj [d_rel, extent]."""
    extent = rel_proj.shape[-1]
    profiles = einsum("bthr,re->bhte", rel, round_to(rel_proj, rel.dtype))  # [B, Hq, T, extent]
    distance = q_positions[:, :, None] - kv_positions[:, None, :]  # [B, T, S]
    index = jnp.clip(distance, 0, extent - 1)[:, None]
    bias = jnp.take_along_axis(profiles, index, axis=-1)
    inside = ((distance >= 0) & (distance < extent))[:, None]
    return jnp.where(inside, bias, jnp.zeros((), bias.dtype))


def relative_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    rel: jax.Array,
    rel_proj: jax.Array,
    sinks: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    *,
    scale: float,
    window: int | None,
) -> jax.Array:
    """Attention output [B, T, Hq, D].

    q [B, T, Hq, D]; k, v [B, S, Hkv, D] (Hkv divides Hq; query head h reads kv head h // (Hq/Hkv));
    rel [B, T, Hq, d_rel]; rel_proj [d_rel, extent]; sinks [B, T, Hq];
    q_positions [B, T], kv_positions [B, S] (int32); window: keys closer than this, or None for all.
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    groups = num_heads // kv_heads
    dtype = q.dtype
    qg = q.reshape(batch, q_len, kv_heads, groups, head_dim)
    scores = einsum("btkgd,bskd->bkgts", qg, k).reshape(batch, num_heads, q_len, -1)
    scores = round_to(scores.astype(jnp.float32) * scale, dtype)
    bias = relative_bias(rel, rel_proj, q_positions, kv_positions)
    scores = round_to(scores.astype(jnp.float32) + bias.astype(jnp.float32), dtype)

    distance = q_positions[:, :, None] - kv_positions[:, None, :]
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    logits = jnp.where(visible[:, None], scores.astype(jnp.float32), -jnp.inf)
    sink = jnp.transpose(sinks, (0, 2, 1))[..., None].astype(jnp.float32)  # [B, Hq, T, 1]
    probs = round_to(softmax(jnp.concatenate([logits, sink], axis=-1))[..., :-1], dtype)

    probs = probs.reshape(batch, kv_heads, groups, q_len, -1)
    out = einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, q_len, num_heads, head_dim)
