"""Saving a loaded model's parameters with Orbax, and restoring them without reconversion.

    python -m inkling_jax.checkpoint.orbax_io --checkpoint SAFETENSORS_DIR --out ORBAX_DIR [--dtype bfloat16]

The directory holds the source config.json, a small `inkling_jax.json` (parameter dtype, expert formats)
and the Orbax parameter tree: exactly what the model holds on device, quantized experts included, so a
restore reads each array once and places it with the sharding of the abstract model (on a mesh, the
partitioning `inkling_jax.sharding` gives each parameter).

A restore reads the tree in groups of parameters (about 1/RESTORE_GROUPS of the bytes each, at least
RESTORE_GROUP_BYTES), so that it can report its progress (`progress`), and checks every restored value for NaN
and Inf on device as the loader does (`finite`). A save reports the bytes written so far. A directory that is
missing, is not such a checkpoint or cannot be read, and an `--out` that exists, raise CheckpointError naming
what is wrong; the command prints it on one line and exits with status 2.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from inkling_jax.checkpoint.errors import CheckpointError
from inkling_jax.checkpoint.finite import FiniteCheck, value_kind
from inkling_jax.checkpoint.loader import abstract_causal_lm, load_causal_lm, parameter_paths, tower_layers
from inkling_jax.checkpoint.progress import Progress
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError, ModelConfig, load_config
from inkling_jax.image_processor import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG
from inkling_jax.model.stack import stacked_rows
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import parameter_shardings
from inkling_jax.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

MARKER = "inkling_jax.json"
PARAMS = "params"
RESTORE_GROUPS = 32  # a restore's progress steps: each Orbax call costs tens of ms, whatever its size...
RESTORE_GROUP_BYTES = 1 << 30  # ...so a group holds at least this much
POLL_S = 1.0  # how often a save's bytes on disk are counted

logger = logging.getLogger("inkling_jax.checkpoint.orbax_io")  # not __name__, "__main__" under python -m


def _check_new_directory(out: Path) -> None:
    """`out` must not exist yet, and the nearest directory above it that does must be writable."""
    if out.exists():
        raise CheckpointError(f"{out} already exists: an Orbax checkpoint is written to a new directory")
    parent = next(parent for parent in out.parents if parent.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot create {out}: {parent} is not a writable directory")


def _bytes_under(directory: Path) -> int:
    """Bytes of the files under `directory` so far (files that vanish while it is walked count 0)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:
                continue
    return total


def _reporting(work: Callable[[], None], progress: Progress, written: Callable[[], int]) -> None:
    """Run `work` in a thread; every POLL_S until it ends, advance `progress` to `written()` bytes (at most its
    total); then to the total. `work`'s exception is raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # handed to the caller's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="orbax-save")
    thread.start()
    while thread.is_alive():
        thread.join(POLL_S)
        progress.advance(0, max(min(written(), progress.total_bytes) - progress.bytes, 0))
    if errors:
        raise errors[0]
    progress.advance(0, progress.total_bytes - progress.bytes)


def save(model: CausalLM, config_json: Path, out: str | Path) -> Path:
    """Write `model`'s parameters (as placed on device) to a new Orbax directory `out`, with the source's
    config, tokenizer and image processor files. While Orbax writes, the progress is the bytes in `out` so far
    (compressed by Orbax, so a little under the parameters' bytes until the end, and the time left an estimate)."""
    out = Path(out).absolute()
    _check_new_directory(out)
    try:
        out.mkdir(parents=True)
        for name in ("config.json", TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, PROCESSOR_CONFIG, PREPROCESSOR_CONFIG):
            source = Path(config_json).parent / name
            if source.is_file():
                shutil.copyfile(source, out / name)
        dtype = model.model.embed_tokens.weight.dtype
        (out / MARKER).write_text(
            json.dumps({"dtype": jnp.dtype(dtype).name, "expert_formats": model.model.expert_formats()})
        )
    except OSError as error:
        raise CheckpointError(f"cannot write {out}: {error}") from error
    params = nnx.state(model, nnx.Param)
    checkpointer = ocp.StandardCheckpointer()

    def write() -> None:
        checkpointer.save(out / PARAMS, params)
        checkpointer.wait_until_finished()

    nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    with Progress(logger, f"saving {out}", None, nbytes) as progress:
        _reporting(write, progress, lambda: _bytes_under(out))
    return out


def is_orbax(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def _is_variable(node: object) -> bool:
    return isinstance(node, nnx.Variable)


def _check_orbax_directory(directory: Path) -> None:
    """What makes `directory` no Orbax checkpoint of ours, named before anything is read."""
    if not directory.exists():
        raise CheckpointError(f"{directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    for name in (MARKER, "config.json"):
        if not (directory / name).is_file():
            raise CheckpointError(f"{directory} is not an Orbax checkpoint of inkling_jax (no {name})")
    if not (directory / PARAMS).is_dir():
        raise CheckpointError(f"{directory}: its Orbax parameters ({PARAMS}/) are missing")


def _nbytes(variable: nnx.Variable) -> int:
    return math.prod(variable.shape) * jnp.dtype(variable.dtype).itemsize


def _groups(variables: dict[str, nnx.Variable]) -> list[list[str]]:
    """Consecutive parameter paths in groups of about 1/RESTORE_GROUPS of the bytes, at least RESTORE_GROUP_BYTES."""
    sizes = {path: _nbytes(variable) for path, variable in variables.items()}
    least = max(sum(sizes.values()) // RESTORE_GROUPS, RESTORE_GROUP_BYTES)
    groups: list[list[str]] = [[]]
    held = 0
    for path, size in sizes.items():
        if held >= least:
            groups.append([])
            held = 0
        groups[-1].append(path)
        held += size
    return groups


def _restored(directory: Path, target: dict[str, nnx.Variable], group: list[str]) -> dict[str, jax.Array]:
    """The parameters `group` names, read from the Orbax tree (each as its target variable's abstract value says:
    shape, dtype, sharding)."""
    keys = {path: (*path.split("."), "value") for path in group}
    item = ocp.tree.from_flat_dict({keys[path]: target[path].get_value() for path in group})
    args = ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
    )
    try:
        restored = ocp.tree.to_flat_dict(ocp.PyTreeCheckpointer().restore(directory / PARAMS, args=args))
        return {path: restored[keys[path]] for path in group}
    except Exception as error:  # Orbax and TensorStore raise plain Exceptions for damaged data
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise CheckpointError(f"{directory}: cannot restore the Orbax parameters: {reason}") from error


def _row_name(path: str, row: int, layer_path: str | None) -> str | None:
    """How an error names a row of a stacked parameter: the row and the layer's parameter it holds."""
    return None if layer_path is None else f"{path}[{row}] ({layer_path})"


def restore(directory: str | Path, mesh: Mesh | None = None) -> tuple[ModelConfig, CausalLM]:
    """The model saved by `save`: on the default device, or with a `mesh` restored straight into the
    shardings `parameter_shardings` gives (each process reads only its devices' slices)."""
    directory = Path(directory).absolute()
    _check_orbax_directory(directory)
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
    state = jax.tree.map(
        lambda variable, sharding: variable.replace(
            jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding)
        ),
        abstract,
        shardings,
        is_leaf=_is_variable,
    )
    variables = parameter_paths(state)
    rows = stacked_rows(config.text, formats, list(variables), tower_layers(config))
    check = FiniteCheck()
    nbytes = sum(_nbytes(variable) for variable in variables.values())
    with Progress(logger, f"restoring {directory}", len(variables), nbytes) as progress:
        for group in _groups(variables):
            for path, array in _restored(directory, variables, group).items():
                variables[path].set_value(array)
                names = path if path not in rows else [_row_name(path, row, name) for row, name in rows[path].items()]
                check.add(array, value_kind(path, array.dtype), names)
            progress.advance(len(group), sum(_nbytes(variables[path]) for path in group))
        check.raise_if_any(str(directory))
    return config, nnx.merge(graphdef, state)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("inkling_jax.checkpoint.orbax_io", "Convert a safetensors checkpoint to an Orbax one")
    parser.add_argument("--checkpoint", required=True, help="safetensors checkpoint directory")
    parser.add_argument("--out", required=True, help="Orbax directory to create")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="parameter dtype")
    args = parser.parse_args(argv)
    from inkling_jax.score import log_to_stderr  # here: inkling_jax.score imports this package

    log_to_stderr()
    out = Path(args.out).absolute()
    try:
        _check_new_directory(out)  # before the load, which may take minutes
        _, model = load_causal_lm(args.checkpoint, jnp.dtype(args.dtype))
        print(save(model, Path(args.checkpoint) / "config.json", out))
    except (ConfigError, CheckpointError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
