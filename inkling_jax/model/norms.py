"""Normalisations and clips, computed in fp32 as transformers computes them."""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.model.params import ones, param
from pallas_kernels.numerics import rms_normalize, round_to, total


def l2_clip(x: jax.Array, threshold: float) -> jax.Array:
    """Scales each vector (last axis) down to L2 norm `threshold` when longer; fp32."""
    x = x.astype(jnp.float32)
    norm = jnp.sqrt(total(jnp.square(x), -1, keepdims=True))
    return x * jnp.minimum(threshold / (norm + 1e-6), 1.0)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    return jnp.tanh(x / cap) * cap


class RMSNorm(nnx.Module):
    """Weighted RMSNorm; the gain multiplies in fp32 and the result returns in the input dtype."""

    def __init__(self, rngs: nnx.Rngs, size: int, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.weight = param(rngs, (size,), ("embed",), dtype, ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        return round_to(self.weight[...].astype(jnp.float32) * rms_normalize(x, self.eps), x.dtype)


class ScaledL2Clip(nnx.Module):
    """A learned per-head, per-channel scale followed by an L2 clip; returns the input dtype."""

    def __init__(self, rngs: nnx.Rngs, num_heads: int, dim: int, threshold: float, dtype: jnp.dtype):
        self.threshold = threshold
        self.scale = param(rngs, (num_heads, dim), ("heads", None), dtype, ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        scaled = x.astype(jnp.float32) * self.scale[...].astype(jnp.float32)
        return round_to(l2_clip(scaled, self.threshold), x.dtype)
