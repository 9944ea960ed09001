"""Inkling 2 relative-bias attention (sliding-window and full layers).

q, k and relative states are L2-clipped (q and relative states after a learned scale), v is
RMS-normalised without gain, K and V pass through short convolutions (static on sliding layers,
input-dependent on full layers). Full layers scale q and the relative states by
tau = 1 + alpha * log(max((pos + 1) / n_floor, 1)). The output is gated by sigmoid(gate_proj(x)).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import TextConfig
from inkling_jax.model.norms import ScaledL2Clip, l2_clip, rms_normalize
from inkling_jax.model.params import Linear, normal, param
from inkling_jax.model.short_conv import DynamicShortConvolution, ShortConvolution
from pallas_kernels.numerics import round_to
from pallas_kernels.relative_attention import relative_attention


class RelativeLogits(nnx.Module):
    """The bank of bias-versus-distance profiles that relative states mix: proj [d_rel, extent]."""

    def __init__(self, rngs: nnx.Rngs, d_rel: int, extent: int, dtype: jnp.dtype, std: float):
        self.proj = param(rngs, (d_rel, extent), (None, None), dtype, normal(std))


def log_length_scale(positions: jax.Array, alpha: float, n_floor: int) -> jax.Array:
    """tau [B, T] in fp32: 1 before position n_floor - 1, growing with log(position) after."""
    ratio = (positions + 1).astype(jnp.float32) / n_floor
    return 1.0 + alpha * jnp.log(jnp.maximum(ratio, 1.0))


class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, layer: int, dtype: jnp.dtype):
        self.config = config
        self.sliding = config.is_sliding(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = config.attention_dims(layer)
        hidden, std = config.hidden_size, config.initializer_range
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        def linear(in_features: int, out_features: int, axes: tuple[str, str]) -> Linear:
            return Linear(rngs, in_features, out_features, axes, dtype, std)

        self.q_proj = linear(hidden, q_size, ("heads", "embed"))
        self.k_proj = linear(hidden, kv_size, ("kv_heads", "embed"))
        self.v_proj = linear(hidden, kv_size, ("kv_heads", "embed"))
        self.r_proj = linear(hidden, self.num_heads * config.d_rel, ("heads", "embed"))
        self.o_proj = linear(q_size, hidden, ("embed", "heads"))
        self.gate_proj = linear(hidden, q_size, ("heads", "embed"))
        self.sink_proj = linear(hidden, self.num_heads, ("heads", "embed"))
        kernel = config.conv_kernel_size
        if self.sliding:
            self.k_sconv = ShortConvolution(rngs, kv_size, kernel, "kv_heads", std)
            self.v_sconv = ShortConvolution(rngs, kv_size, kernel, "kv_heads", std)
        else:
            self.k_sconv = DynamicShortConvolution(rngs, kv_size, hidden, self.num_kv_heads, kernel, dtype, std)
            self.v_sconv = DynamicShortConvolution(rngs, kv_size, hidden, self.num_kv_heads, kernel, dtype, std)
        self.rel_logits_proj = RelativeLogits(rngs, config.d_rel, config.relative_extent(layer), dtype, std)
        self.q_l2_clip = ScaledL2Clip(rngs, self.num_heads, self.head_dim, config.qk_l2_clip_threshold, dtype)
        self.rel_l2_clip = ScaledL2Clip(rngs, self.num_heads, config.d_rel, config.rel_l2_clip_threshold, dtype)

    def _convolve(self, conv: nnx.Module, x: jax.Array, source: jax.Array) -> jax.Array:
        return conv(x) if self.sliding else conv(x, source)

    def __call__(self, q_in: jax.Array, k_in: jax.Array, v_in: jax.Array, positions: jax.Array) -> jax.Array:
        """q_in, k_in, v_in [B, T, H] (the same array on sliding layers); positions [B, T] -> [B, T, H]."""
        config = self.config
        batch, length, _ = q_in.shape
        dtype = q_in.dtype
        heads = (batch, length, self.num_heads, -1)
        kv_heads = (batch, length, self.num_kv_heads, self.head_dim)

        q = self.q_l2_clip(self.q_proj(q_in).reshape(heads))
        k = self._convolve(self.k_sconv, self.k_proj(k_in), k_in)
        v = self._convolve(self.v_sconv, self.v_proj(v_in), v_in)
        k = round_to(l2_clip(k.reshape(kv_heads), config.qk_l2_clip_threshold), dtype)
        v = round_to(rms_normalize(v.reshape(kv_heads), config.rms_norm_eps), dtype)
        rel = self.rel_l2_clip(self.r_proj(q_in).reshape(heads))
        if not self.sliding:
            tau = log_length_scale(positions, config.log_scaling_alpha, config.log_scaling_n_floor)
            tau = tau[:, :, None, None]
            q = round_to(q.astype(jnp.float32) * tau, dtype)
            rel = round_to(rel.astype(jnp.float32) * tau, dtype)

        out = relative_attention(
            q, k, v, rel, self.rel_logits_proj.proj[...], self.sink_proj(q_in), positions, positions,
            scale=self.head_dim**-0.5, window=config.sliding_window_size if self.sliding else None,
        )  # fmt: skip
        gate = jax.nn.sigmoid(self.gate_proj(q_in).astype(jnp.float32))
        out = round_to(out.reshape(batch, length, -1).astype(jnp.float32) * gate, dtype)
        return self.o_proj(out)
