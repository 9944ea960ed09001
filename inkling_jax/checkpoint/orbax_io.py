"""Saving a loaded model's parameters with Orbax, and restoring them without reconversion.

    python -m inkling_jax.checkpoint.orbax_io --checkpoint SAFETENSORS_DIR --out ORBAX_DIR [--dtype bfloat16]

The directory holds the source config.json, a small `inkling_jax.json` (parameter dtype, expert formats)
and the Orbax parameter tree: exactly what the model holds on device, quantized experts included, so a
restore reads each array once and places it with the sharding of the abstract model (on a mesh, the
partitioning `inkling_jax.sharding` gives each parameter).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from inkling_jax.checkpoint.errors import CheckpointError
from inkling_jax.checkpoint.loader import abstract_causal_lm, load_causal_lm
from inkling_jax.config import ModelConfig, load_config
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import parameter_shardings
from inkling_jax.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

MARKER = "inkling_jax.json"
PARAMS = "params"


def save(model: CausalLM, config_json: Path, out: str | Path) -> Path:
    """Write `model`'s parameters (as placed on device) to an Orbax directory `out`, with the source's
    config and tokenizer files."""
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=False)
    for name in ("config.json", TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        source = Path(config_json).parent / name
        if source.is_file():
            shutil.copyfile(source, out / name)
    dtype = model.model.embed_tokens.weight.dtype
    (out / MARKER).write_text(
        json.dumps({"dtype": jnp.dtype(dtype).name, "expert_formats": model.model.expert_formats()})
    )
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(out / PARAMS, nnx.state(model, nnx.Param))
    checkpointer.wait_until_finished()
    return out


def is_orbax(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def _is_variable(node: object) -> bool:
    return isinstance(node, nnx.Variable)


def restore(directory: str | Path, mesh: Mesh | None = None) -> tuple[ModelConfig, CausalLM]:
    """The model saved by `save`: on the default device, or with a `mesh` restored straight into the
    shardings `parameter_shardings` gives (each process reads only its devices' slices)."""
    directory = Path(directory).absolute()
    try:
        meta = json.loads((directory / MARKER).read_text())
        dtype, formats = jnp.dtype(meta["dtype"]), meta["expert_formats"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{directory}: unreadable {MARKER}: {error}") from error
    config = load_config(directory)
    model = abstract_causal_lm(config, dtype, formats)
    graphdef, abstract = nnx.split(model)
    if mesh is None:
        device = SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, abstract, is_leaf=_is_variable)
    else:
        shardings = parameter_shardings(model, mesh)
    target = jax.tree.map(
        lambda variable, sharding: variable.replace(
            jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding)
        ),
        abstract,
        shardings,
        is_leaf=_is_variable,
    )
    try:
        state = ocp.StandardCheckpointer().restore(directory / PARAMS, target)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{directory}: cannot restore the Orbax parameters: {error}") from error
    return config, nnx.merge(graphdef, state)


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert a safetensors checkpoint to an Orbax one")
    parser.add_argument("--checkpoint", required=True, help="safetensors checkpoint directory")
    parser.add_argument("--out", required=True, help="Orbax directory to create")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    _, model = load_causal_lm(args.checkpoint, jnp.dtype(args.dtype))
    print(save(model, Path(args.checkpoint) / "config.json", args.out))


if __name__ == "__main__":
    main()
