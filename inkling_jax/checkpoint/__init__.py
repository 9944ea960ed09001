"""Checkpoints: lazy safetensors reading, the original and transformers name maps, synthetic checkpoints."""

from inkling_jax.checkpoint.loader import CheckpointError, load_causal_lm

__all__ = ["CheckpointError", "load_causal_lm"]
