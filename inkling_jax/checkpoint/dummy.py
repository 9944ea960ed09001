"""Dummy weights (`--load-format dummy`): a random model of any config, built directly on the devices.

Nothing is read but the config: every parameter is initialised under `jax.jit` straight into the shards
`inkling_jax.sharding.parameter_shardings` gives it, so a model of any size builds at device speed with no
host copy. The routed experts take the formats the config's `quantization_config` states (plain, MXFP8,
NVFP4, or mixed per layer, as the checkpoint would hold them), and the DSpark draft is built when the config
has a `dspark_config`. For measuring and testing the serving paths at full size: the output is noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.config import ModelConfig
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import parameter_shardings


def dummy_model(config: ModelConfig, dtype: jnp.dtype, mesh: Mesh, seed: int = 0, source: str = "") -> CausalLM:
    """A random CausalLM of `config` (with its draft, experts in the configured formats), each parameter
    created in its shards on `mesh`. `source` names the config in errors."""
    formats = configured_expert_formats(source or "config", config.quantization, config.text.num_hidden_layers)
    return random_model(config, dtype, mesh, formats, seed)


def random_model(
    config: ModelConfig, dtype: jnp.dtype, mesh: Mesh, expert_formats: Sequence[str | None], seed: int = 0
) -> CausalLM:
    """A random CausalLM of `config` with the given per-layer expert formats (None: plain), and its draft when
    the config has one, built under jit straight into the shards `parameter_shardings` gives each parameter."""

    def make() -> CausalLM:
        return CausalLM(config.text, dtype, nnx.Rngs(seed), expert_formats, config.draft)

    abstract = nnx.eval_shape(make)
    graphdef, _ = nnx.split(abstract)
    state = jax.jit(lambda: nnx.split(make())[1], out_shardings=parameter_shardings(abstract, mesh))()
    return nnx.merge(graphdef, state)
