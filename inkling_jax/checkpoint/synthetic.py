"""Synthetic Inkling 2 checkpoints: random weights for any config, in the transformers layout.

Every parameter gets non-trivial values (including those the reference initialises to zeros or ones:
attention-residual queries, clip scales, norm gains, correction bias, dynamic static taps), so that a
checkpoint exercises every path of the model. Used for the default served checkpoint and for tests.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.checkpoint.loader import parameter_paths
from inkling_jax.checkpoint.safetensors_io import SINGLE_FILE, write_safetensors, write_sharded
from inkling_jax.config import load_config
from inkling_jax.model.text import CausalLM


def synthetic_tensors(config_path: str | Path, seed: int) -> dict[str, np.ndarray]:
    """float32 tensors of a random model for the text config at `config_path`, by checkpoint name."""
    text = load_config(config_path).text
    _, state = nnx.split(CausalLM(text, jnp.float32, nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    tensors = {}
    for path, variable in parameter_paths(state).items():
        value = np.asarray(jax.device_get(variable[...]), np.float32)
        if path.endswith((".query", ".static_weight", ".e_score_correction_bias")):
            value = rng.normal(0.0, 0.5, value.shape)
        elif path.endswith(("norm.weight", "layernorm.weight", "l2_clip.scale")):
            value = rng.uniform(0.5, 1.5, value.shape)
        elif path.endswith(".conv1d.weight"):
            value = rng.normal(0.0, 0.3, value.shape)
        elif path == "model.embed_tokens.weight":
            value = rng.normal(0.0, 1.0, value.shape)
        tensors[path] = value.astype(np.float32)
    return tensors


def write_checkpoint(config_path: str | Path, out: str | Path, seed: int = 0, num_shards: int = 1) -> Path:
    """Write config.json and random weights for `config_path` to directory `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = synthetic_tensors(config_path, seed)
    (out / "config.json").write_text(json.dumps(json.loads(Path(config_path).read_text()), indent=2))
    if num_shards == 1:
        write_safetensors(out / SINGLE_FILE, tensors)
    else:
        write_sharded(out, tensors, num_shards)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a random Inkling 2 checkpoint for a (tiny) config")
    parser.add_argument("--config", required=True, help="config.json describing the model")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    args = parser.parse_args()
    print(write_checkpoint(args.config, args.out, args.seed, args.shards))


if __name__ == "__main__":
    main()
