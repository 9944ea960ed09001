"""The MoE feed-forward: sigmoid router with a selection-only correction bias, softcapped SwiGLU experts."""

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import TextConfig
from inkling_jax.model.params import normal, param, zeros
from pallas_kernels.moe import moe_experts
from pallas_kernels.numerics import einsum


class Router(nnx.Module):
    """Picks top-k experts by sigmoid score + correction bias; weights are the chosen scores,
    normalised to sum to one and multiplied by route_scale. fp32."""

    def __init__(self, rngs: nnx.Rngs, config: TextConfig):
        self.top_k = config.num_experts_per_tok
        self.route_scale = config.route_scale
        experts, hidden = config.n_routed_experts, config.hidden_size
        self.weight = param(rngs, (experts, hidden), (None, "embed"), jnp.float32, normal(config.initializer_range))
        self.e_score_correction_bias = param(rngs, (experts,), (None,), jnp.float32, zeros)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, H] -> (expert ids [N, k] int32, weights [N, k] fp32)."""
        logits = einsum("nh,eh->ne", x.astype(jnp.float32), self.weight[...].astype(jnp.float32))
        scores = jax.nn.sigmoid(logits)
        _, experts = jax.lax.top_k(scores + self.e_score_correction_bias[...], self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return experts.astype(jnp.int32), weights * self.route_scale


class Experts(nnx.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I]."""

    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype):
        experts, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        init = normal(config.initializer_range)
        self.gate_up_proj = param(rngs, (experts, 2 * inner, hidden), ("experts", "expert_mlp", "embed"), dtype, init)
        self.down_proj = param(rngs, (experts, hidden, inner), ("experts", "embed", "expert_mlp"), dtype, init)


class SparseMoeBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype):
        self.config = config
        self.gate = Router(rngs, config)
        self.experts = Experts(rngs, config, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, H] -> [B, T, H]."""
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        out = moe_experts(
            flat, self.experts.gate_up_proj[...], self.experts.down_proj[...], experts, weights,
            gate_cap=self.config.mlp_gate_softcap, up_cap=self.config.mlp_up_softcap,
        )  # fmt: skip
        return out.reshape(x.shape)
