"""Parameter counts of an Inkling 2 config, from shapes alone (nothing is allocated).

The text stack (with the DSpark draft when the config has one) is counted from `jax.eval_shape` of
`CausalLM`; the image tower (not modelled in JAX yet) from the tensor shapes transformers'
`Inkling2VisionModel` declares for the config. `parameter_bytes` is what the text stack and draft hold on a
device in bf16, the routed experts in the formats the config's `quantization_config` states.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from inkling_jax.checkpoint.loader import abstract_causal_lm, checkpoint_parameters, parameter_paths
from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.cli import argument_parser
from inkling_jax.config import ModelConfig, VisionConfig, load_config


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


def vision_parameters(vision: VisionConfig) -> int:
    """Parameters of the ViT tower and its projector, from its config."""
    width, inner, merged = vision.hidden_size, vision.intermediate_size, vision.spatial_merge_size**2
    bias = vision.projection_hidden_dim + vision.text_hidden_size if vision.projector_bias else 0
    embeddings = vision.num_channels * vision.patch_size**2 * width + vision.posemb_grid_size**2 * width + 2 * width
    layer = 4 * (width * width + width) + 2 * width * inner + inner + width + 4 * width + 2 * width
    projector = merged * width * vision.projection_hidden_dim + vision.projection_hidden_dim * vision.text_hidden_size
    return embeddings + 2 * width + vision.num_hidden_layers * layer + projector + bias


def count_parameters(config: ModelConfig) -> ParameterCounts:
    sizes = {path: math.prod(var.shape) for path, var in checkpoint_parameters(config, jnp.bfloat16).items()}
    routed = sum(size for path, size in sizes.items() if ".mlp.experts." in path)
    text = config.text
    return ParameterCounts(
        text=sum(sizes.values()),
        vision=vision_parameters(config.vision) if config.vision is not None else 0,
        routed_experts=routed,
        active_experts=routed * text.num_experts_per_tok // text.n_routed_experts,
        embedding=sizes["model.embed_tokens.weight"],
    )


def parameter_bytes(config: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> int:
    """Bytes of the text stack's and draft's parameters in `dtype`, experts as the config stores them."""
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
