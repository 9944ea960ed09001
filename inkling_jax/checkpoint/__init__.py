"""Checkpoints: lazy safetensors reading in the original and transformers layouts, quantized experts,
Orbax save/restore, synthetic checkpoints. `load_model` is the entry point for either kind of directory."""

from pathlib import Path

import jax.numpy as jnp
from jax.sharding import Mesh

from inkling_jax.checkpoint.errors import CheckpointError
from inkling_jax.checkpoint.loader import load_causal_lm
from inkling_jax.config import ModelConfig
from inkling_jax.model.text import CausalLM


def load_model(
    checkpoint: str | Path, dtype: jnp.dtype = jnp.bfloat16, mesh: Mesh | None = None
) -> tuple[ModelConfig, CausalLM]:
    """A safetensors checkpoint (converted on load) or an Orbax one written by `orbax_io.save`; with a
    `mesh`, every parameter is read straight into its shards (`inkling_jax.sharding.parameter_shardings`)."""
    # imported here, not with the package: `python -m inkling_jax.checkpoint.orbax_io` runs that module as
    # __main__, and importing it with the package first would make a second copy of it (runpy warns)
    from inkling_jax.checkpoint import orbax_io

    if orbax_io.is_orbax(checkpoint):
        config, model = orbax_io.restore(checkpoint, mesh)
        saved = model.model.embed_tokens.weight.dtype
        if saved != jnp.dtype(dtype):
            raise CheckpointError(f"{checkpoint} holds {saved} parameters; convert the safetensors again for {dtype}")
        return config, model
    return load_causal_lm(checkpoint, dtype, mesh)


__all__ = ["CheckpointError", "load_causal_lm", "load_model"]
