"""Block attention residuals: learned queries attend over the block sources and the partial block.

Sources and partial sum are RMS-normalised (no gain, eps 1e-6) and serve as both keys and values;
the queries are the same at every position. fp32 throughout. The module holds the queries; the mix
itself, fused with the RMSNorm after it, is `pallas_kernels.attn_res` (see `text.mixed_norms`).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.model.params import param, zeros


class BlockAttentionResidual(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden_size: int, num_queries: int = 1):
        shape = (hidden_size,) if num_queries == 1 else (num_queries, hidden_size)
        axes = ("embed",) if num_queries == 1 else (None, "embed")
        self.query = param(rngs, shape, axes, jnp.float32, zeros)

    def queries(self) -> jax.Array:
        """[Q, H] fp32."""
        query = self.query[...].astype(jnp.float32)
        return query.reshape(-1, query.shape[-1])
