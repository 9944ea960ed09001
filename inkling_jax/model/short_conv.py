"""Causal short convolutions with a residual, over one sequence of tokens.

Static: per-channel taps (torch conv1d layout [C, 1, K]: tap K-1 weights the current token),
out = (conv(x) + x) / sqrt(K + 1). Dynamic (full layers' K and V): per-channel static taps
`static_weight[lag]` plus per-token taps projected from another input and shared within a KV head,
out = (conv(x) + x) / sqrt(2K + 1). Both run in fp32 and return the input dtype.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.model.params import Linear, normal, param, zeros
from pallas_kernels.numerics import round_to


def lagged(x: jax.Array, kernel_size: int) -> jax.Array:
    """[..., T, C] -> [K, ..., T, C] with [lag, ..., t, c] = x[..., t - lag, c], zeros before the start: a whole
    sequence's inputs at each lag (a step over a cache gathers them with its history, `Chunk.lags`). Lag-major, so
    that each lag's inputs are one contiguous slice."""
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(kernel_size - 1, 0), (0, 0)])
    length = x.shape[-2]
    first = kernel_size - 1
    return jnp.stack([padded[..., first - lag : first - lag + length, :] for lag in range(kernel_size)])


def conv_window(history: jax.Array, x: jax.Array) -> jax.Array:
    """history [B, K - 1, C] followed by a chunk's inputs x [B, T, C] -> the window [B, K - 1 + T, C] in
    history's dtype: every input the history after any prefix of the chunk can hold."""
    return jnp.concatenate([history, x.astype(history.dtype)], axis=1)


def committed_history(window: jax.Array, commit: jax.Array, taps: int) -> jax.Array:
    """window [B, taps + T, C] (`conv_window`, taps = K - 1), commit [B] in 0..T -> [B, taps, C]: the
    latest inputs once the first commit[b] of the chunk's T are kept, window[b, commit[b] : commit[b] + taps]
    (how a speculative step rolls a verify pass back to its accepted tokens)."""
    index = commit[:, None] + jnp.arange(taps)[None, :]  # [B, taps]
    return jnp.take_along_axis(window, index[:, :, None], axis=1)


class DepthwiseTaps(nnx.Module):
    """The static taps, stored as transformers' `conv1d.weight` [C, 1, K] (kept in fp32 like the reference)."""

    def __init__(self, rngs: nnx.Rngs, channels: int, kernel_size: int, axis: str | None, std: float):
        self.weight = param(rngs, (channels, 1, kernel_size), (axis, None, None), jnp.float32, normal(std))


class ShortConvolution(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, channels: int, kernel_size: int, axis: str | None, std: float):
        self.kernel_size = kernel_size
        self.conv1d = DepthwiseTaps(rngs, channels, kernel_size, axis, std)

    def __call__(self, x: jax.Array, lags: jax.Array | None = None) -> jax.Array:
        """x [B, T, C] -> [B, T, C]; lags [K, B, T, C]: x's inputs at each lag, with what came before (None: x
        is a whole sequence)."""
        xf = x.astype(jnp.float32)
        taps = self.conv1d.weight[...][:, 0].astype(jnp.float32)  # [C, K]: tap K - 1 - lag weights lag `lag`
        lags = lagged(xf, self.kernel_size) if lags is None else lags.astype(jnp.float32)
        # a sum of K products over the lags' slices: not a dot (XLA:GPU makes a dot of 4 taps a gemm kernel), nor a
        # reduction over reversed taps (in a scanned layer XLA:GPU copies them out transposed, a kernel per layer)
        last = self.kernel_size - 1
        out = sum(lags[lag] * taps[:, last - lag] for lag in range(self.kernel_size))
        return round_to((out + xf) / math.sqrt(self.kernel_size + 1), x.dtype)


class DynamicShortConvolution(nnx.Module):
    def __init__(
        self,
        rngs: nnx.Rngs,
        channels: int,
        input_size: int,
        num_heads: int,
        kernel_size: int,
        dtype: jnp.dtype,
        std: float,
    ):
        self.kernel_size = kernel_size
        self.num_heads = num_heads
        self.static_weight = param(rngs, (kernel_size, channels), (None, "kv_heads"), dtype, zeros)
        self.weight_proj = Linear(rngs, input_size, num_heads * kernel_size, (None, "embed"), dtype, std)

    def __call__(self, x: jax.Array, dynamic_input: jax.Array, lags: jax.Array | None = None) -> jax.Array:
        """x [B, T, C], dynamic_input [B, T, H_in] -> [B, T, C]; lags as `ShortConvolution` takes them."""
        batch, length, channels = x.shape
        dynamic = self.weight_proj(dynamic_input).astype(jnp.float32)
        dynamic = dynamic.reshape(batch, length, self.num_heads, 1, self.kernel_size)
        static = self.static_weight[...].astype(jnp.float32).T.reshape(self.num_heads, -1, self.kernel_size)
        taps = (static + dynamic).reshape(batch, length, channels, self.kernel_size)
        xf = x.astype(jnp.float32)
        lags = lagged(xf, self.kernel_size) if lags is None else lags.astype(jnp.float32)
        out = sum(lags[lag] * taps[..., lag] for lag in range(self.kernel_size))
        return round_to((out + xf) / math.sqrt(2 * self.kernel_size + 1), x.dtype)
