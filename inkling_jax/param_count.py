"""Parameter counts of an Inkling 2 config, from shapes alone (nothing is allocated).

The text stack (with the DSpark draft when the config has one) and the image tower are counted from
`jax.eval_shape` of `CausalLM`. `parameter_bytes` is what the whole model holds on a device in bf16, the routed
experts in the formats the config's `quantization_config` states.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from inkling_jax.checkpoint.loader import abstract_causal_lm, checkpoint_parameters, parameter_paths
from inkling_jax.checkpoint.names import is_vision_path
from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.cli import argument_parser
from inkling_jax.config import ModelConfig, load_config


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    text: int
    vision: int
    routed_experts: int
    active_experts: int
    embedding: int

    @property
    def total(self) -> int:
        return self.text + self.vision

    @property
    def active_per_token(self) -> int:
        """Text parameters one token's forward reads: all but the unselected experts."""
        return self.text - self.routed_experts + self.active_experts

    @property
    def active_per_token_without_embedding(self) -> int:
        """Same, less the embedding table (a row lookup, not a matmul)."""
        return self.active_per_token - self.embedding


def count_parameters(config: ModelConfig) -> ParameterCounts:
    sizes = {path: math.prod(var.shape) for path, var in checkpoint_parameters(config, jnp.bfloat16).items()}
    routed = sum(size for path, size in sizes.items() if ".mlp.experts." in path)
    vision = sum(size for path, size in sizes.items() if is_vision_path(path))
    text = config.text
    return ParameterCounts(
        text=sum(sizes.values()) - vision,
        vision=vision,
        routed_experts=routed,
        active_experts=routed * text.num_experts_per_tok // text.n_routed_experts,
        embedding=sizes["model.embed_tokens.weight"],
    )


def parameter_bytes(config: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> int:
    """Bytes of the model's parameters (text stack, draft, image tower) in `dtype`, experts as the config stores
    them."""
    formats = configured_expert_formats("config", config.quantization, config.text.num_hidden_layers)
    _, state = nnx.split(abstract_causal_lm(config, dtype, formats))
    return sum(math.prod(var.shape) * var.dtype.itemsize for var in parameter_paths(state).values())


def main(argv: list[str] | None = None) -> None:
    """`python -m inkling_jax.param_count` (`inkling-param-count`): print a config's counts and bytes."""
    parser = argument_parser("inkling_jax.param_count", "Parameter counts of an Inkling 2 config.json")
    parser.add_argument("config", help="config.json or a checkpoint directory")
    dtype_help = "dtype of the parameters whose bytes are counted (routed experts: as the config stores them)"
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help=dtype_help)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    counts = count_parameters(config)
    for name in ("total", "text", "vision", "routed_experts", "active_per_token", "active_per_token_without_embedding"):
        print(f"{name:>36}: {getattr(counts, name):>16,} ({getattr(counts, name) / 1e9:.2f}B)")
    size = parameter_bytes(config, jnp.dtype(args.dtype))
    print(f"{f'bytes ({args.dtype}, experts as config)':>36}: {size:>16,} ({size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
