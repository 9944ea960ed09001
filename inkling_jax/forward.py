"""Jitted whole-sequence forward passes over a loaded model: scoring (with or without images) and cache-free
greedy decoding.

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
from inkling_jax.model.vision import ImageInputError, check_image_inputs, check_placeholders


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


@functools.partial(jax.jit, static_argnums=0)
def _image_features(
    graphdef: nnx.GraphDef, state: nnx.State, pixel_values: jax.Array, image_grid_thw: jax.Array
) -> jax.Array:
    return nnx.merge(graphdef, state).vision_tower(pixel_values, image_grid_thw)


@functools.partial(jax.jit, static_argnums=0)
def _logits_with_features(
    graphdef: nnx.GraphDef, state: nnx.State, token_ids: jax.Array, features: jax.Array
) -> jax.Array:
    return nnx.merge(graphdef, state)(token_ids, image_features=features)


def image_features_fn(model: CausalLM) -> Callable[[np.ndarray, np.ndarray], jax.Array]:
    """pixel_values [tiles, M*P, M*P, C], image_grid_thw [images, 3] -> the image tower's features [tiles, H]
    (parameter dtype); checked on the host first (ImageInputError), compiled once per tile and image count."""
    if model.vision_tower is None:
        raise ImageInputError("the model has no image tower (its config has no vision_config)")
    graphdef, state = nnx.split(model)
    config = model.vision_tower.config

    def features(pixel_values: np.ndarray, image_grid_thw: np.ndarray) -> jax.Array:
        check_image_inputs(pixel_values, image_grid_thw, config)
        pixels = jnp.asarray(pixel_values, jnp.float32)
        return _image_features(graphdef, state, pixels, jnp.asarray(image_grid_thw, jnp.int32))

    return features


def multimodal_logits(
    model: CausalLM, token_ids: Sequence[int] | np.ndarray, pixel_values: np.ndarray, image_grid_thw: np.ndarray
) -> jax.Array:
    """float32 logits [T, unpadded_vocab] of one causal forward over `token_ids` [T] whose image placeholders
    (one per tile, contiguous, the images in order) take the features of the images (`pixel_values`,
    `image_grid_thw` as the image processor gives them). Inputs that do not fit raise ImageInputError before any
    device work."""
    ids = np.asarray(token_ids, np.int32)
    if model.vision_tower is None:
        raise ImageInputError("the model has no image tower (its config has no vision_config)")
    check_image_inputs(pixel_values, image_grid_thw, model.vision_tower.config)
    check_placeholders(ids, np.asarray(pixel_values).shape[0], model.image_token_id)
    features = image_features_fn(model)(pixel_values, image_grid_thw)
    graphdef, state = nnx.split(model)
    return _logits_with_features(graphdef, state, jnp.asarray(ids[None]), features)[0]


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
