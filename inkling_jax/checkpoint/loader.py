"""Loading an Inkling 2 checkpoint into `CausalLM`, one tensor at a time, experts kept as stored.

Every tensor is checked against the parameter it fills: unknown, duplicated or missing tensors, wrong
shapes, dtypes or sidecars raise `CheckpointError` naming the tensor (and both shapes), before any
tensor data is read; global scales are checked as they are read, and every other value on device once
placed (`finite`: NaN or Inf in any weight or scale is refused, naming each tensor that holds one), before
the model is returned. Given a mesh, each parameter is built straight into its shards from the slices this
process's devices own. A checkpoint whose config has a `dspark_config` loads its DSpark draft (`dspark.*`
tensors) the same way, into `CausalLM.dspark`; `dspark.*` tensors without the config are an error. An `inkling2`
config's image tower (`model.visual.*` or `model.vision_tower.*`, never quantized) loads into `CausalLM.vision_tower`
in the model's dtype and sharded like the rest; a missing tower tensor is named as the layout would store it. A load
reports its progress (`progress`): tensors and bytes placed, the rate and the time left.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from inkling_jax.checkpoint.errors import CheckpointError
from inkling_jax.checkpoint.finite import FiniteCheck, value_kind
from inkling_jax.checkpoint.names import (
    DATA,
    GLOBAL_SCALE,
    IGNORED,
    Index,
    Transform,
    detect_layout,
    is_draft,
    is_ignored,
    is_vision,
    is_vision_path,
    text_parameter,
    vision_checkpoint_name,
)
from inkling_jax.checkpoint.progress import Progress
from inkling_jax.checkpoint.quantized import (
    FLOAT_DTYPES,
    check_global_scale,
    check_quantization_config,
    expert_format,
    per_expert,
    stored_array,
)
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles, SafetensorsError
from inkling_jax.config import ModelConfig, load_config
from inkling_jax.model.stack import layer_parameters, stacked_rows
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import parameter_shardings

logger = logging.getLogger(__name__)


def parameter_paths(model_state: nnx.State) -> dict[str, nnx.Variable]:
    """Dotted parameter path -> variable, for every parameter of a split model."""
    return {".".join(str(part) for part in path): var for path, var in nnx.to_flat_state(model_state)}


def parameter_bytes(model: nnx.Module) -> int:
    """Device bytes of a model's parameters (quantized experts count as stored)."""
    return sum(v.nbytes for v in parameter_paths(nnx.state(model)).values())


def abstract_causal_lm(
    config: ModelConfig, dtype: jnp.dtype, expert_formats: Sequence[str | None] | None = None
) -> CausalLM:
    """The model's structure (with the draft when the config has one), shapes and dtypes only; nothing
    allocated."""
    return nnx.eval_shape(
        lambda: CausalLM(
            config.text, dtype, nnx.Rngs(0), expert_formats, config.draft, config.vision, config.image_token_id
        )
    )


def checkpoint_parameters(
    config: ModelConfig, dtype: jnp.dtype, expert_formats: Sequence[str | None] | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """Every parameter as checkpoints name them (a layer's by `model.layers.{i}.…`), with its shape and dtype."""
    formats = expert_formats if expert_formats is not None else [None] * config.text.num_hidden_layers
    _, state = nnx.split(abstract_causal_lm(config, dtype, formats))
    variables = parameter_paths(state)
    return layer_parameters(variables, stacked_rows(config.text, formats, list(variables), tower_layers(config)))


def tower_layers(config: ModelConfig) -> int:
    """The image tower's depth (0: no tower), for `stacked_rows`."""
    return 0 if config.vision is None else config.vision.num_hidden_layers


def named_parameters(model: CausalLM) -> dict[str, jax.Array]:
    """A model's parameters as checkpoints name them (rows of stacked layers under their layers' names)."""
    variables = parameter_paths(nnx.state(model))
    depth = 0 if model.vision_tower is None else model.vision_tower.config.num_hidden_layers
    rows = stacked_rows(model.config, model.model.expert_formats(), list(variables), depth)
    named = {path: variable[...] for path, variable in variables.items() if path not in rows}
    for path, by_row in rows.items():
        named |= {name: variables[path][...][row] for row, name in by_row.items() if name is not None}
    return named


_EXPERT_TARGET = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


class Tensor(NamedTuple):
    """One checkpoint tensor in the load plan."""

    name: str
    role: str | None
    format: str | None
    transform: Transform


def _group(checkpoint: Path, files: CheckpointFiles, config: ModelConfig) -> tuple[str, dict[str, dict]]:
    """Checkpoint tensors grouped by the weight they make up: target -> {role: Mapped, ...}."""
    layout = detect_layout(files.names())
    groups: dict[str, dict] = {}
    skipped = []
    for name in files.names():
        if is_ignored(name):
            skipped.append(name)
            continue
        if is_vision(name) and config.vision is None:
            raise CheckpointError(
                f"{checkpoint}: tensor {name!r} belongs to an image tower, but config.json has no vision_config"
            )
        if is_draft(name) and config.draft is None:
            raise CheckpointError(
                f"{checkpoint}: tensor {name!r} belongs to a DSpark draft, but config.json has no dspark_config"
            )
        mapped = text_parameter(name, layout)
        if mapped is None:
            raise CheckpointError(f"{checkpoint}: unexpected tensor {name!r} ({layout} layout)")
        if mapped.role is IGNORED:
            continue
        group = groups.setdefault(mapped.target, {})
        if mapped.role in group:
            raise CheckpointError(
                f"{checkpoint}: tensors {group[mapped.role][0]!r} and {name!r} both fill {mapped.target!r}"
            )
        group[mapped.role] = (name, mapped.transform)
    if skipped:
        logger.info("not loaded: %s", ", ".join(skipped[:4]) + ("..." if len(skipped) > 4 else ""))
    return layout, groups


def _expert_formats(checkpoint: Path, files: CheckpointFiles, config: ModelConfig, groups: dict) -> list:
    """Each layer's expert format (None for plain), decided from its tensors."""
    text = config.text
    shapes = {
        "gate_up_proj": (text.n_routed_experts, 2 * text.moe_intermediate_size, text.hidden_size),
        "down_proj": (text.n_routed_experts, text.hidden_size, text.moe_intermediate_size),
    }
    formats: dict[int, str | None] = {}
    for target, group in groups.items():
        m = _EXPERT_TARGET.fullmatch(target)
        if m is None or int(m.group(1)) >= text.num_hidden_layers:
            if set(group) != {DATA}:
                raise CheckpointError(f"{checkpoint}: quantization sidecars for {target!r}, which is not an expert")
            continue
        if DATA not in group:
            raise CheckpointError(f"{checkpoint}: sidecars of {target!r} without its data tensor")
        layer = int(m.group(1))
        format = expert_format(checkpoint, files, {role: name for role, (name, _) in group.items()}, shapes[m.group(2)])
        if formats.setdefault(layer, format) != format:
            raise CheckpointError(f"{checkpoint}: layer {layer}'s two expert weights are stored in different formats")
    check_quantization_config(checkpoint, config.quantization, formats)
    return [formats.get(layer) for layer in range(text.num_hidden_layers)]


def _plan(
    checkpoint: Path, files: CheckpointFiles, layout: str, groups: dict, formats: list, expected: dict
) -> dict[str, Tensor]:
    """Parameter path -> the tensor that fills it, with names, shapes and dtypes checked from the headers."""
    plan: dict[str, Tensor] = {}
    for target, group in groups.items():
        m = _EXPERT_TARGET.fullmatch(target)
        format = formats[int(m.group(1))] if m else None
        for role, (name, transform) in group.items():
            path = target if format is None else f"{target}.{role}"
            if path not in expected:
                raise CheckpointError(f"{checkpoint}: unexpected tensor {name!r} ({layout} layout)")
            entry, needed = files.entry(name), tuple(expected[path].shape)
            if format is None:
                if entry.shape != needed:
                    raise CheckpointError(
                        f"{checkpoint}: tensor {name!r} has shape {entry.shape}, the config needs {needed}"
                    )
                if entry.dtype not in FLOAT_DTYPES:
                    raise CheckpointError(
                        f"{checkpoint}: tensor {name!r} has dtype {entry.dtype}, expected float32/bfloat16/float16"
                    )
            plan[path] = Tensor(name, role, format, transform)
    missing = sorted(
        vision_checkpoint_name(path, layout) if is_vision_path(path) else path for path in set(expected) - set(plan)
    )
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{checkpoint}: missing tensors for {shown} ({layout} layout)")
    return plan


def _parameter_slice(
    checkpoint: Path, files: CheckpointFiles, tensor: Tensor, index: Index, dtype: jnp.dtype, experts: int
) -> np.ndarray:
    """The `index` slice of the parameter `tensor` fills. Only the stored slice it needs is cut from the
    memory-mapped file; that slice alone is transformed, checked and converted to `dtype`, into memory of
    its own (never a view of the file, which could change under the model)."""
    try:
        if tensor.role == GLOBAL_SCALE:  # one value per expert, stored in several shapes: mapped whole, then cut
            source = files.read(tensor.name)
            check_global_scale(checkpoint, tensor.name, source)
            part = per_expert(source, experts)[index]
        else:
            source = files.read(tensor.name, tensor.transform.source(index))
            part = tensor.transform(source, index)
        if tensor.format is not None:
            part = stored_array(tensor.role, tensor.format, part)
        return part.astype(dtype, copy=np.may_share_memory(part, source))
    except OSError as error:
        raise CheckpointError(f"{checkpoint}: cannot read tensor {tensor.name!r}: {error}") from error


def _stacked_slice(
    read: Callable[[str, Index], np.ndarray], rows: dict[int, str | None], shape: tuple[int, ...], dtype, index: Index
) -> np.ndarray:
    """The `index` slice of a stacked parameter [blocks, ...]: each of its rows read from the layer's tensor that
    fills it (zeros for a hole, a row no checkpoint stores)."""
    selected = range(*index[0].indices(shape[0]))
    parts = [
        np.zeros(tuple(len(range(*i.indices(n))) for i, n in zip(index[1:], shape[1:], strict=True)), dtype)
        if rows[row] is None
        else read(rows[row], index[1:])
        for row in selected
    ]
    return np.stack(parts)


def _placed(shape: tuple[int, ...], sharding: NamedSharding | None, read: Callable[[Index], np.ndarray]) -> jax.Array:
    """A parameter made of `read(index)` slices: whole on the default device without a sharding; else
    each distinct slice this process's devices hold (the addressable ones: multi-process safe) is read
    once, put on every such device that holds it and dropped before the next is read, so host memory
    holds one slice at a time (`jax.make_array_from_callback` would gather them all before placing any)."""
    if sharding is None:
        return jax.device_put(read(tuple(slice(None) for _ in shape)))
    devices: dict[Index, list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        devices.setdefault(index, []).append(device)
    shards = []
    for index, group in devices.items():
        part = read(index)
        shards += [jax.device_put(part, device) for device in group]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _checked_kind(path: str, dtype: jnp.dtype, tensors: Sequence[Tensor]) -> str | None:
    """What the finite check looks for in a placed parameter (`finite.value_kind`): nothing in a global scale,
    checked whole as it was read (`check_global_scale`), nor in a stacked parameter no tensor fills."""
    return None if not tensors or tensors[0].role == GLOBAL_SCALE else value_kind(path, dtype)


def load_causal_lm(
    checkpoint: str | Path, dtype: jnp.dtype = jnp.bfloat16, mesh: Mesh | None = None
) -> tuple[ModelConfig, CausalLM]:
    """Read config.json and the safetensors weights of `checkpoint` (either layout) into a CausalLM (with
    its DSpark draft as `model.dspark` when the config has a `dspark_config`, else `model.dspark` is None).

    Experts stay in the format the checkpoint stores them in (plain, MXFP8 or NVFP4). Every name, shape
    and dtype is checked before any data is read; tensors are then read, checked and placed one at a time,
    and their values checked for NaN / Inf on device once all are placed.
    With a `mesh`, each parameter is created with the sharding `parameter_shardings` gives it, from just
    the slices this process's devices own, so host memory beyond the placed parameters stays within one
    slice; without one, parameters go whole to the default device, one tensor at a time.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} is not a checkpoint directory (config.json + safetensors)")
    config = load_config(checkpoint)
    try:
        files = CheckpointFiles(checkpoint)
    except SafetensorsError as error:
        raise CheckpointError(str(error)) from error
    layout, groups = _group(checkpoint, files, config)
    formats = _expert_formats(checkpoint, files, config, groups)
    abstract = abstract_causal_lm(config, dtype, formats)
    graphdef, state = nnx.split(abstract)
    variables = parameter_paths(state)
    rows = stacked_rows(config.text, formats, list(variables), tower_layers(config))
    named = layer_parameters(variables, rows)
    shardings = parameter_paths(parameter_shardings(abstract, mesh)) if mesh is not None else {}
    plan = _plan(checkpoint, files, layout, groups, formats, named)
    experts = config.text.n_routed_experts
    check = FiniteCheck()
    stored = sum(files.entry(tensor.name).nbytes for tensor in plan.values())
    with Progress(logger, f"loading {checkpoint}", len(plan), stored) as progress:
        for path, variable in variables.items():

            def tensor_slice(name: str, index: Index, dtype: jnp.dtype = variable.dtype) -> np.ndarray:
                return _parameter_slice(checkpoint, files, plan[name], index, dtype=dtype, experts=experts)

            if path in rows:
                shape = tuple(variable.shape)
                read = functools.partial(_stacked_slice, tensor_slice, rows[path], shape, variable.dtype)
                names = [None if name is None else plan[name].name for name in rows[path].values()]
                tensors = [plan[name] for name in rows[path].values() if name is not None]
            else:
                read = functools.partial(tensor_slice, path)
                names, tensors = plan[path].name, [plan[path]]
            variable.set_value(_placed(tuple(variable.shape), shardings.get(path), read))
            check.add(variable[...], _checked_kind(path, variable.dtype, tensors), names)
            progress.advance(len(tensors), sum(files.entry(tensor.name).nbytes for tensor in tensors))
        check.raise_if_any(str(checkpoint))
    model = nnx.merge(graphdef, state)
    read_bytes = sum(files.entry(name).nbytes for name in files.names())
    logger.info(
        "%s: %.1f MiB of tensors -> %.1f MiB on device", checkpoint, read_bytes / 2**20, parameter_bytes(model) / 2**20
    )
    return config, model
