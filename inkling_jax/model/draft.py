"""The DSpark speculative draft: DeepSpec's DSpark with the RNN sequential head, restated in
research/dspark_attnres.md section 1.

One round at anchor position s (the last sampled token, not yet run through the target), gamma slots:
- context features: c_t = RMSNorm(fc([H^(l1)_t; ...; H^(lm)_t])) from the target's layer outputs at the
  configured layers, for committed positions t < s (`context_features`);
- every draft layer projects c_t into its own context K/V (`context_kv`). They depend only on c_t and t,
  so the engine computes them once per position fed and keeps them (in the full-attention page pool);
  a block reads only positions before its anchor, all committed, so rejected ones need no rollback;
- the block [E(anchor), E(mask), ..., E(mask)] at positions s .. s+gamma-1 runs through the draft
  layers, attending to the context positions < s and to the whole block in both directions
  (`block_hidden` -> h [S, gamma, d]); slot k predicts position s+k+1 (the anchor slot predicts);
- base logits U_k = target.logits(h_k), through the target's LM head;
- the RNN head adds a bias from the previous token, with a state that is zero at the start of every
  block (`rnn_step`): q_k = softmax(U_k + bias_k) is the draft distribution x_k is sampled from;
- the confidence head estimates P(x_k accepted | all earlier drafts accepted) (`confidence`).

The target's embedding and LM head are used, never copied. Parameter names are DeepSpec's (`fc`,
`hidden_norm`, `layers.{i}.self_attn.q_proj`, `markov_head.markov_w1`, ...), so the checkpoint's
`dspark.*` tensors load by name (`inkling_jax.checkpoint.names`). Pure jnp; matmuls accumulate in fp32
(`pallas_kernels.numerics.einsum`) and round to the activation dtype (the parameters'); norms, softmax,
RoPE, the RNN head and the confidence head compute in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.config import DraftConfig, ModelConfig, TextConfig
from inkling_jax.model.norms import RMSNorm
from inkling_jax.model.params import Linear, normal, param, zeros
from pallas_kernels.numerics import einsum, round_to, softmax


class NoDraftError(ValueError):
    """Speculation was requested from a checkpoint that ships no DSpark draft."""


def require_draft(model_or_config: object, checkpoint: str = "") -> DraftConfig:
    """The draft config of a `ModelConfig` or a loaded `CausalLM`, or NoDraftError saying what to do."""
    if isinstance(model_or_config, ModelConfig):
        draft = model_or_config.draft
    else:
        module = getattr(model_or_config, "dspark", None)
        draft = None if module is None else module.config
    if draft is None:
        raise NoDraftError(
            f"checkpoint {checkpoint or '(given)'} has no DSpark draft (no dspark_config / dspark.* tensors); "
            "run without --speculative"
        )
    return draft


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """x [..., T, H, D] rotated by its positions [..., T] (rotate-half RoPE); fp32 math, x's dtype."""
    dim = x.shape[-1]
    inverse = theta ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None, None] * inverse  # [..., T, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return round_to(rotated, x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Grouped-query softmax attention: q [S, G, H, D] over k, v [S, L, Hkv, D] where visible [S, L]
    (query head h reads KV head h // (H / Hkv)) -> [S, G, H, D] in q's dtype."""
    slots, width, heads, dim = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(slots, width, kv_heads, heads // kv_heads, dim)
    scores = einsum("sgkhd,slkd->skhgl", q, k, jnp.float32) * dim**-0.5
    scores = jnp.where(visible[:, None, None, None, :], scores, -jnp.inf)
    probs = softmax(scores)
    out = einsum("skhgl,slkd->sgkhd", probs, v.astype(jnp.float32), q.dtype)
    return out.reshape(slots, width, heads, dim)


class BiasedLinear(Linear):
    """y = x @ weight.T + bias (weight [out, in], bias [out])."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        in_features: int,
        out_features: int,
        axes: tuple[str | None, str | None],
        dtype: jnp.dtype,
        std: float,
    ):
        super().__init__(rngs, in_features, out_features, axes, dtype, std)
        self.bias = param(rngs, (out_features,), axes[:1], dtype, zeros)

    def __call__(self, x: jax.Array) -> jax.Array:
        return round_to(super().__call__(x).astype(jnp.float32) + self.bias[...].astype(jnp.float32), x.dtype)


class DraftAttention(nnx.Module):
    """Qwen3-style attention: q/k RMS-normalised per head, RoPE, GQA, no biases. Its K/V projections
    serve both the context features and the block."""

    def __init__(self, rngs: nnx.Rngs, config: DraftConfig, dtype: jnp.dtype, std: float):
        self.theta = config.rope_theta
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden, q_size, kv_size = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(rngs, hidden, q_size, ("heads", "embed"), dtype, std)
        self.k_proj = Linear(rngs, hidden, kv_size, ("kv_heads", "embed"), dtype, std)
        self.v_proj = Linear(rngs, hidden, kv_size, ("kv_heads", "embed"), dtype, std)
        self.o_proj = Linear(rngs, q_size, hidden, ("embed", "heads"), dtype, std)
        self.q_norm = RMSNorm(rngs, self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(rngs, self.head_dim, config.rms_norm_eps, dtype)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, d] at positions [B, T] -> K = RoPE(k_norm(W_K x)), V = W_V x, each [B, T, Hkv, D]."""
        shape = (*x.shape[:2], self.num_kv_heads, self.head_dim)
        k = rope(self.k_norm(self.k_proj(x).reshape(shape)), positions, self.theta)
        return k, self.v_proj(x).reshape(shape)

    def __call__(
        self, u: jax.Array, positions: jax.Array, context_k: jax.Array, context_v: jax.Array, context_visible: jax.Array
    ) -> jax.Array:
        """Block states u [S, G, d] at positions [S, G] attend to the visible context K/V [S, L, Hkv, D]
        and to every slot of the block -> [S, G, d]."""
        slots, width, _ = u.shape
        q = rope(
            self.q_norm(self.q_proj(u).reshape(slots, width, self.num_heads, self.head_dim)), positions, self.theta
        )
        block_k, block_v = self.keys_values(u, positions)
        k = jnp.concatenate([context_k.astype(u.dtype), block_k], axis=1)
        v = jnp.concatenate([context_v.astype(u.dtype), block_v], axis=1)
        visible = jnp.concatenate([context_visible, jnp.ones((slots, width), bool)], axis=1)
        return self.o_proj(attend(q, k, v, visible).reshape(slots, width, -1))


class SwiGLU(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int, intermediate: int, dtype: jnp.dtype, std: float):
        self.gate_proj = Linear(rngs, hidden, intermediate, ("expert_mlp", "embed"), dtype, std)
        self.up_proj = Linear(rngs, hidden, intermediate, ("expert_mlp", "embed"), dtype, std)
        self.down_proj = Linear(rngs, intermediate, hidden, ("embed", "expert_mlp"), dtype, std)

    def __call__(self, x: jax.Array) -> jax.Array:
        """down(silu(gate(x)) * up(x)), the product in fp32."""
        gated = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)) * self.up_proj(x).astype(jnp.float32)
        return self.down_proj(round_to(gated, x.dtype))


def _add(x: jax.Array, y: jax.Array) -> jax.Array:
    """Residual add in fp32, rounded to x's dtype."""
    return round_to(x.astype(jnp.float32) + y.astype(jnp.float32), x.dtype)


class DraftLayer(nnx.Module):
    """Pre-norm: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)). The context
    features reach the attention as K/V only, without this layer's input norm."""

    def __init__(self, rngs: nnx.Rngs, config: DraftConfig, dtype: jnp.dtype, std: float):
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(rngs, hidden, eps, dtype)
        self.self_attn = DraftAttention(rngs, config, dtype, std)
        self.post_attention_layernorm = RMSNorm(rngs, hidden, eps, dtype)
        self.mlp = SwiGLU(rngs, hidden, config.intermediate_size, dtype, std)

    def __call__(
        self, x: jax.Array, positions: jax.Array, context_k: jax.Array, context_v: jax.Array, context_visible: jax.Array
    ) -> jax.Array:
        """x [S, G, d] -> [S, G, d]."""
        x = _add(x, self.self_attn(self.input_layernorm(x), positions, context_k, context_v, context_visible))
        return _add(x, self.mlp(self.post_attention_layernorm(x)))


def draft_layer(config: DraftConfig, text: TextConfig, dtype: jnp.dtype) -> Callable[[nnx.Rngs], DraftLayer]:
    """How each of the draft's layers is made from its rngs."""
    return functools.partial(DraftLayer, config=config, dtype=dtype, std=text.initializer_range)


class Embedding(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int, width: int, dtype: jnp.dtype, std: float):
        self.weight = param(rngs, (vocab, width), ("vocab", None), dtype, normal(std))

    def __call__(self, token_ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], token_ids, axis=0)


class RNNHead(nnx.Module):
    """DSpark's RNN sequential head (paper Eq. 6), in fp32:
        z_k = [s_{k-1}; W1[x_{k-1}]; h_k];  [a_g; a_c; a_o] = W_j z_k + b_j   (chunks: gate, candidate, output)
        s_k = sigmoid(a_g) * s_{k-1} + (1 - sigmoid(a_g)) * tanh(a_c);  bias_k = W2 tanh(a_o)
    The bias at step k reads the old state s_{k-1}; s_{-1} = 0 in every block; x_{-1} is the anchor."""

    def __init__(self, rngs: nnx.Rngs, vocab: int, rank: int, hidden: int, dtype: jnp.dtype, std: float):
        self.rank = rank
        self.markov_w1 = Embedding(rngs, vocab, rank, dtype, std)
        self.markov_w2 = Linear(rngs, rank, vocab, ("vocab", None), dtype, std)
        self.joint_proj = BiasedLinear(rngs, 2 * rank + hidden, 3 * rank, (None, None), dtype, std)

    def __call__(self, state: jax.Array, prev_token: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """state [S, r] fp32, prev_token [S], h [S, d] -> (next state [S, r], bias [S, padded V]) in fp32."""
        prev = self.markov_w1(prev_token).astype(jnp.float32)
        z = jnp.concatenate([state, prev, h.astype(jnp.float32)], axis=-1)
        gate, candidate, output = jnp.split(self.joint_proj(z), 3, axis=-1)
        gate = jax.nn.sigmoid(gate)
        state = gate * state + (1.0 - gate) * jnp.tanh(candidate)
        return state, self.markov_w2(jnp.tanh(output))


class ConfidenceHead(nnx.Module):
    """c_k = sigmoid(w . [h_k; W1[x_{k-1}]] + b), the estimated chance that draft k is accepted given
    that every earlier one was."""

    def __init__(self, rngs: nnx.Rngs, hidden: int, rank: int, dtype: jnp.dtype, std: float):
        self.proj = BiasedLinear(rngs, hidden + rank, 1, (None, None), dtype, std)

    def __call__(self, h: jax.Array, prev_embedding: jax.Array) -> jax.Array:
        """h [S, d], prev_embedding [S, r] -> [S] fp32."""
        features = jnp.concatenate([h.astype(jnp.float32), prev_embedding.astype(jnp.float32)], axis=-1)
        return jax.nn.sigmoid(self.proj(features)[..., 0])


class Draft(nnx.Module):
    """The DSpark draft's own parameters (everything but the shared embedding and LM head)."""

    def __init__(self, rngs: nnx.Rngs, config: DraftConfig, text: TextConfig, dtype: jnp.dtype):
        self.config = config
        self.vocab = text.unpadded_vocab_size
        hidden, std, eps = config.hidden_size, text.initializer_range, config.rms_norm_eps
        features = len(config.target_layer_ids) * text.hidden_size
        self.fc = Linear(rngs, features, hidden, ("embed", None), dtype, std)
        self.hidden_norm = RMSNorm(rngs, hidden, eps, dtype)
        self.layers = nnx.List([draft_layer(config, text, dtype)(rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(rngs, hidden, eps, dtype)
        self.markov_head = RNNHead(rngs, text.vocab_size, config.markov_rank, hidden, dtype, std)
        self.confidence_head = ConfidenceHead(rngs, hidden, config.markov_rank, dtype, std)

    def context_features(self, hidden_at_layers: jax.Array) -> jax.Array:
        """The target's layer outputs [B, T, m, d] (layers in `target_layer_ids` order) ->
        c = hidden_norm(fc([H^(l1); ...; H^(lm)])) [B, T, d]."""
        batch, length, layers, width = hidden_at_layers.shape
        return self.hidden_norm(self.fc(hidden_at_layers.reshape(batch, length, layers * width)))

    def context_kv(self, c: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Context features c [B, T, d] at positions [B, T] -> every draft layer's context K and V,
        each [layers, B, T, Hkv, D] (K after k_norm and RoPE): what the engine stores per committed position."""
        kvs = [layer.self_attn.keys_values(c, positions) for layer in self.layers]
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

    def block_hidden(
        self,
        anchor_ids: jax.Array,
        anchor_positions: jax.Array,
        context_k: jax.Array,
        context_v: jax.Array,
        context_positions: jax.Array,
        embed: Callable[[jax.Array], jax.Array],
    ) -> jax.Array:
        """One draft pass: anchor_ids, anchor_positions [S]; context K/V [layers, S, L, Hkv, D] holding
        positions context_positions [S, L] (entries at or after the anchor's position are not read, so
        stale or unwritten ones are harmless); embed: the target's token embedding with its norm
        (`CausalLM.model.embed_tokens`)
        -> final-normed hidden states h [S, gamma, d]; slot k predicts position anchor + k + 1."""
        gamma = self.config.block_size
        slots = anchor_ids.shape[0]
        mask = jnp.full((slots, gamma - 1), self.config.mask_token_id, anchor_ids.dtype)
        x = embed(jnp.concatenate([anchor_ids[:, None], mask], axis=1))  # [S, gamma, d]
        positions = anchor_positions[:, None] + jnp.arange(gamma, dtype=anchor_positions.dtype)[None, :]
        visible = context_positions < anchor_positions[:, None]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, context_k[i], context_v[i], visible)
        return self.norm(x)

    def initial_state(self, h: jax.Array) -> jax.Array:
        """The RNN head's state at the start of every block: zeros [S, r] fp32 for the block's hidden
        states h [S, gamma, d] (made from h, so under shard_map it varies over the same axes)."""
        return jnp.broadcast_to(jnp.zeros_like(h[:, 0, :1], jnp.float32), (h.shape[0], self.config.markov_rank))

    def rnn_step(self, state: jax.Array, prev_token: jax.Array, h_k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Slot k of the sequential head: state [S, r] (s_{k-1}), prev_token [S] (x_{k-1}; the anchor at
        k = 0), h_k [S, d] -> (s_k, bias_k [S, unpadded V]) in fp32; q_k = softmax(U_k + bias_k)."""
        state, bias = self.markov_head(state, prev_token, h_k)
        return state, bias[..., : self.vocab]

    def block_biases(self, anchor_ids: jax.Array, drafts: jax.Array, h: jax.Array) -> jax.Array:
        """Every slot's bias for known drafts [S, gamma] (teacher forcing: slot k reads drafts[k - 1]),
        the state starting at zero: [S, gamma, unpadded V] fp32, equal to gamma `rnn_step`s."""
        previous = jnp.concatenate([anchor_ids[:, None], drafts[:, :-1]], axis=1)

        def step(state: jax.Array, inputs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            return self.rnn_step(state, *inputs)

        _, biases = jax.lax.scan(step, self.initial_state(h), (previous.T, jnp.swapaxes(h, 0, 1)))
        return jnp.swapaxes(biases, 0, 1)

    def confidence(self, h_k: jax.Array, prev_token: jax.Array) -> jax.Array:
        """c_k [S] fp32 from h_k [S, d] and x_{k-1} [S] (uncalibrated: no per-slot temperatures)."""
        return self.confidence_head(h_k, self.markov_head.markov_w1(prev_token))
