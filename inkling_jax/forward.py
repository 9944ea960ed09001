"""Jitted whole-sequence forward passes over a loaded model: scoring and cache-free greedy decoding.

These recompute the full prefix (no decode state); the engine's incremental step lives in serving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.model.text import CausalLM


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(token_ids)


@functools.partial(jax.jit, static_argnums=0)
def _argmax_at(graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, position: jax.Array) -> jax.Array:
    logits = nnx.merge(graphdef, state)(token_ids[None])[0]
    return jnp.argmax(logits[position]).astype(jnp.int32)


def logits_fn(model: CausalLM) -> Callable[[jax.Array], jax.Array]:
    """token_ids [B, T] -> float32 logits [B, T, unpadded_vocab]; compiled once per model structure and shape."""
    graphdef, state = nnx.split(model)
    return lambda token_ids: _logits(graphdef, state, token_ids)


def greedy_continuation(model: CausalLM, prompt: Sequence[int], max_tokens: int) -> list[int]:
    """Argmax continuation of `prompt`, recomputing the prefix each token with one fixed shape.

    Positions after the current prefix hold padding; causality keeps them out of earlier logits.
    """
    graphdef, state = nnx.split(model)
    token_ids = np.zeros(len(prompt) + max_tokens, np.int32)
    token_ids[: len(prompt)] = prompt
    for position in range(len(prompt), len(token_ids)):
        token = _argmax_at(graphdef, state, jnp.asarray(token_ids), jnp.int32(position - 1))
        token_ids[position] = int(token)
    return token_ids[len(prompt) :].tolist()
