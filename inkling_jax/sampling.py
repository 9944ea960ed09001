"""On-device sampling with per-request parameters, inside the jitted step.

For each slot: penalties (repetition over prompt and output tokens, presence and frequency over output
tokens, as vLLM defines them), then greedy (temperature 0) or sampling from the temperature-scaled
distribution restricted by top-k, top-p and min-p. A request's random stream depends only on its seed
and on how many tokens it has generated, never on its slot or the rest of the batch. Log-probabilities
are those of the model's own distribution (log-softmax of the raw logits), as vLLM reports by default.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-slot sampling parameters, each [S]. The neutral value of each disables it."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = all tokens
    top_p: jax.Array  # float32; 1 = all tokens
    min_p: jax.Array  # float32; 0 = all tokens
    repetition_penalty: jax.Array  # float32; 1 = off
    presence_penalty: jax.Array  # float32; 0 = off
    frequency_penalty: jax.Array  # float32; 0 = off
    seed: jax.Array  # uint32

    @classmethod
    def neutral(cls, slots: int) -> SamplingParams:
        """Greedy decoding with every filter and penalty off, for `slots` slots."""
        zeros, ones = jnp.zeros(slots, jnp.float32), jnp.ones(slots, jnp.float32)
        return cls(zeros, jnp.zeros(slots, jnp.int32), ones, zeros, ones, zeros, zeros, jnp.zeros(slots, jnp.uint32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Sampled:
    tokens: jax.Array  # [S] int32
    logprobs: jax.Array  # [S] float32, of the chosen token
    top_ids: jax.Array  # [S, n] int32, the n most likely tokens
    top_logprobs: jax.Array  # [S, n] float32


def penalize(logits: jax.Array, params: SamplingParams, output_counts: jax.Array, prompt_mask: jax.Array) -> jax.Array:
    """logits [S, V] after repetition (prompt or output tokens), presence and frequency (output) penalties.

    output_counts [S, V] int32: how often each token was generated; prompt_mask [S, V] bool.
    """
    counts = output_counts.astype(jnp.float32)
    seen = prompt_mask | (output_counts > 0)
    repetition = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0)


def filtered_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """[S, V]: the temperature-scaled logits in vocabulary order, -inf outside top-k, top-p and min-p (each
    measured on the whole scaled distribution; a token tied with the last one top-k or top-p keeps is kept too).
    The vocabulary is sorted only when some slot asks for top-k or top-p: at decode that sort costs more than
    any layer, and each row's result is the same either way."""
    temperature = jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    scaled = logits / temperature
    probs = jax.nn.softmax(scaled, axis=-1)
    keep = probs >= params.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    ranked_filters = jnp.any(params.top_k > 0) | jnp.any(params.top_p < 1)
    floor = jax.lax.cond(ranked_filters, _ranked_floor, _no_floor, scaled, params)
    return jnp.where(keep & (scaled >= floor), scaled, -jnp.inf)


def _ranked_floor(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    """[S, 1]: each row's smallest scaled logit that top-k and top-p keep (its smallest of all without them)."""
    ranked = -jnp.sort(-scaled, axis=-1)
    probs = jax.nn.softmax(ranked, axis=-1)
    rank = jnp.arange(scaled.shape[-1])[None, :]
    keep = (params.top_k[:, None] <= 0) | (rank < params.top_k[:, None])
    keep &= (jnp.cumsum(probs, axis=-1) - probs) < params.top_p[:, None]  # the mass before a token
    return jnp.min(jnp.where(keep, ranked, jnp.inf), axis=-1, keepdims=True)


def _no_floor(scaled: jax.Array, params: SamplingParams) -> jax.Array:
    return jnp.where(False, scaled[:, :1], -jnp.inf)  # varies over the mesh where scaled does


TOP_K_ROUND = 16  # the most values per row XLA:GPU's TopK kernel takes (more is a sort of the whole row)


def most_likely(logprobs: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(logprobs, n)` over the last axis ([..., V] -> values, int32 ids [..., n]) in rounds of at most
    TOP_K_ROUND, each after the rounds before are masked out: at n = 20 over the vocabulary a single top_k is a full
    sort of every row on the GPU (1.4 ms of a decode step on the H200). Rows need n finite values."""
    values, ids = [], []
    for first in range(0, max(n, 1), TOP_K_ROUND):
        if first:
            logprobs = jnp.put_along_axis(logprobs, ids[-1], -jnp.inf, axis=-1, inplace=False)
        top, at = jax.lax.top_k(logprobs, min(n - first, TOP_K_ROUND))
        values.append(top)
        ids.append(at)
    return jnp.concatenate(values, axis=-1), jnp.concatenate(ids, axis=-1).astype(jnp.int32)


def request_keys(seed: jax.Array, generated: jax.Array) -> jax.Array:
    """One PRNG key per slot, from the request's seed and its count of generated tokens."""
    return jax.vmap(lambda s, g: jax.random.fold_in(jax.random.key(s), g))(seed, generated)


def sample(
    logits: jax.Array,
    params: SamplingParams,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    generated: jax.Array,
    num_top: int = 0,
) -> Sampled:
    """The next token of every slot.

    logits [S, V] float32; output_counts [S, V]; prompt_mask [S, V]; generated [S] int32 (tokens each
    request has produced so far); num_top: how many top log-probabilities to return (static).
    """
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    penalized = penalize(logits, params, output_counts, prompt_mask)
    sampled = jax.vmap(jax.random.categorical)(request_keys(params.seed, generated), filtered_logits(penalized, params))
    tokens = jnp.where(params.temperature > 0, sampled, jnp.argmax(penalized, axis=-1)).astype(jnp.int32)
    top_logprobs, top_ids = most_likely(logprobs, num_top)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
