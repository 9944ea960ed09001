"""The engine's pure step: continue every slot's sequence by a chunk of tokens and sample one token.

    step(graphdef, params, state, batch) -> (outputs, state)     # jitted once per (slots, chunk width)

A step's tokens are laid out [S, C]: slot s brings counts[s] real tokens (a prefill chunk, or the one
token a decoding sequence sampled last), padded to the bucket width C; a slot with counts 0 idles.
Every slot that brings tokens samples from the logits after its last real token; where `emit` is set
the token counts as generated (penalties, seeded stream), elsewhere (a prompt's earlier chunks) it is
discarded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.cache import DecodeState
from inkling_jax.model.attention import AttentionCache, Chunk
from inkling_jax.model.text import CausalLM, LayerCache
from inkling_jax.sampling import Sampled, SamplingParams, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """What the host sends each step (all [S, ...])."""

    token_ids: jax.Array  # [S, C] int32, the first counts[s] real
    counts: jax.Array  # [S] int32
    reset: jax.Array  # [S] bool: a new sequence starts in this slot (its state is cleared first)
    is_prompt: jax.Array  # [S] bool: the tokens are prompt tokens (they join the repetition-penalty set)
    emit: jax.Array  # [S] bool: the sampled token is kept (the prompt's last chunk, or decoding)
    page_table: jax.Array  # [S, max pages] int32, host-owned page assignments
    sampling: SamplingParams


def _layer_caches(model: CausalLM, state: DecodeState) -> list[LayerCache]:
    caches, sliding, full = [], 0, 0
    for i in range(model.config.num_hidden_layers):
        if model.config.is_sliding(i):
            k, v, sliding = state.sliding_k[sliding], state.sliding_v[sliding], sliding + 1
        else:
            k, v, full = state.full_k[full], state.full_v[full], full + 1
        attention = AttentionCache(k, v, state.conv_k[i], state.conv_v[i])
        caches.append(LayerCache(attention, state.conv_attention[i], state.conv_mlp[i]))
    return caches


def _stack(model: CausalLM, caches: list[LayerCache], state: DecodeState) -> DecodeState:
    sliding = [c.attention for i, c in enumerate(caches) if model.config.is_sliding(i)]
    full = [c.attention for i, c in enumerate(caches) if not model.config.is_sliding(i)]

    def stacked(parts: list[jax.Array], like: jax.Array) -> jax.Array:
        return jnp.stack(parts) if parts else like

    return dataclasses.replace(
        state,
        sliding_k=stacked([a.k for a in sliding], state.sliding_k),
        sliding_v=stacked([a.v for a in sliding], state.sliding_v),
        full_k=stacked([a.k for a in full], state.full_k),
        full_v=stacked([a.v for a in full], state.full_v),
        conv_k=jnp.stack([c.attention.k_history for c in caches]),
        conv_v=jnp.stack([c.attention.v_history for c in caches]),
        conv_attention=jnp.stack([c.attention_history for c in caches]),
        conv_mlp=jnp.stack([c.mlp_history for c in caches]),
    )


def _reset(state: DecodeState, reset: jax.Array) -> DecodeState:
    """Clear the per-sequence state of the slots where a new sequence starts."""

    def clear(x: jax.Array, axis: int) -> jax.Array:
        shape = [1] * x.ndim
        shape[axis] = reset.shape[0]
        return jnp.where(reset.reshape(shape), jnp.zeros((), x.dtype), x)

    return dataclasses.replace(
        state,
        conv_k=clear(state.conv_k, 1),
        conv_v=clear(state.conv_v, 1),
        conv_attention=clear(state.conv_attention, 1),
        conv_mlp=clear(state.conv_mlp, 1),
        lengths=clear(state.lengths, 0),
        output_counts=clear(state.output_counts, 0),
        prompt_mask=clear(state.prompt_mask, 0),
        generated=clear(state.generated, 0),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "num_top"), donate_argnames="state")
def step(
    graphdef: nnx.GraphDef, params: nnx.State, state: DecodeState, batch: StepBatch, num_top: int = 0
) -> tuple[Sampled, DecodeState]:
    """One engine step (state donated). Outputs are meaningful for slots with counts > 0."""
    model = nnx.merge(graphdef, params)
    state = dataclasses.replace(_reset(state, batch.reset), page_table=batch.page_table)
    chunk = Chunk(state.lengths, batch.counts, state.page_table, batch.token_ids.shape[1])
    logits, caches = model.step(batch.token_ids, _layer_caches(model, state), chunk)
    state = _stack(model, caches, state)

    slots = jnp.arange(batch.counts.shape[0])[:, None]
    prompt_tokens = jnp.where(chunk.valid & batch.is_prompt[:, None], batch.token_ids, state.prompt_mask.shape[1])
    prompt_mask = state.prompt_mask.at[slots, prompt_tokens].set(True, mode="drop")
    sampled = sample(logits, batch.sampling, state.output_counts, prompt_mask, state.generated, num_top)
    emit = batch.emit & (batch.counts > 0)
    chosen = jnp.where(emit, sampled.tokens, state.output_counts.shape[1])
    state = dataclasses.replace(
        state,
        lengths=state.lengths + batch.counts,
        prompt_mask=prompt_mask,
        output_counts=state.output_counts.at[slots[:, 0], chosen].add(1, mode="drop"),
        generated=state.generated + emit.astype(jnp.int32),
    )
    return sampled, state
