"""Block attention residuals: learned queries attend over the block sources and the partial block.

Sources and partial sum are RMS-normalised (no gain, eps 1e-6) and serve as both keys and values;
the queries are the same at every position. fp32 throughout.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.model.norms import rms_normalize
from inkling_jax.model.params import param, zeros
from pallas_kernels.numerics import einsum


class BlockAttentionResidual(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden_size: int, num_queries: int = 1):
        shape = (hidden_size,) if num_queries == 1 else (num_queries, hidden_size)
        axes = ("embed",) if num_queries == 1 else (None, "embed")
        self.query = param(rngs, shape, axes, jnp.float32, zeros)

    def __call__(self, sources: list[jax.Array], partial: jax.Array) -> list[jax.Array]:
        """sources: S arrays [B, T, H]; partial [B, T, H] -> one fp32 [B, T, H] mix per query."""
        stacked = rms_normalize(jnp.stack([*sources, partial], axis=-2), 1e-6)  # [B, T, S+1, H]
        hidden = stacked.shape[-1]
        queries = self.query[...].astype(jnp.float32).reshape(-1, hidden)  # [Q, H]
        logits = einsum("qh,btsh->btqs", queries, stacked) * hidden**-0.5
        mixed = einsum("btqs,btsh->btqh", jax.nn.softmax(logits, axis=-1), stacked)
        return [mixed[:, :, i] for i in range(queries.shape[0])]
