"""Loading an unquantized Inkling 2 checkpoint into `CausalLM`, one tensor at a time.

Every tensor is checked against the parameter it fills: unknown, duplicated or missing tensors, wrong
shapes and non-float dtypes raise `CheckpointError` naming the tensor (and both shapes), before any
tensor data is read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.checkpoint.names import detect_layout, is_ignored, is_vision, text_parameter
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles, SafetensorsError
from inkling_jax.config import ModelConfig, load_config
from inkling_jax.model.text import CausalLM

logger = logging.getLogger(__name__)


FLOAT_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float16, np.float64, jnp.bfloat16))


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


def parameter_paths(model_state: nnx.State) -> dict[str, nnx.Variable]:
    """Dotted parameter path -> variable, for every parameter of a split model."""
    return {".".join(str(part) for part in path): var for path, var in nnx.to_flat_state(model_state)}


def abstract_causal_lm(config: ModelConfig, dtype: jnp.dtype) -> CausalLM:
    """The model's structure with shapes and dtypes only; nothing allocated."""
    return nnx.eval_shape(lambda: CausalLM(config.text, dtype, nnx.Rngs(0)))


def _plan(checkpoint: Path, files: CheckpointFiles, config: ModelConfig, expected: dict) -> dict[str, tuple]:
    """Parameter path -> (tensor name, transform) for every parameter, checked from the headers alone."""
    layout = detect_layout(files.names())
    plan: dict[str, tuple] = {}
    skipped = []
    for name in files.names():
        if (config.vision is not None and is_vision(name)) or is_ignored(name):
            skipped.append(name)
            continue
        mapped = text_parameter(name, layout)
        if mapped is None or mapped[0] not in expected:
            raise CheckpointError(f"{checkpoint}: unexpected tensor {name!r} ({layout} layout)")
        path, transform = mapped
        if path in plan:
            raise CheckpointError(f"{checkpoint}: tensors {plan[path][0]!r} and {name!r} both fill {path!r}")
        entry, needed = files.entry(name), tuple(expected[path].shape)
        if entry.shape != needed:
            raise CheckpointError(f"{checkpoint}: tensor {name!r} has shape {entry.shape}, the config needs {needed}")
        if entry.dtype not in FLOAT_DTYPES:
            quantized = " (quantized data: MXFP8 / NVFP4 checkpoints are not loadable yet)"
            raise CheckpointError(
                f"{checkpoint}: tensor {name!r} has dtype {entry.dtype}, expected float32/bfloat16/float16"
                + (quantized if entry.dtype.itemsize == 1 else "")
            )
        plan[path] = (name, transform)
    missing = sorted(set(expected) - set(plan))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{checkpoint}: missing tensors for {shown} ({layout} layout)")
    if skipped:
        logger.info("not loaded by the text model: %s", ", ".join(skipped[:4]) + ("..." if len(skipped) > 4 else ""))
    return plan


def load_causal_lm(checkpoint: str | Path, dtype: jnp.dtype = jnp.bfloat16) -> tuple[ModelConfig, CausalLM]:
    """Read config.json and the safetensors weights of `checkpoint` (either layout) into a CausalLM.

    Every name, shape and dtype is checked before any data is read; tensors are then read and placed
    one at a time.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} is not a checkpoint directory (config.json + safetensors)")
    config = load_config(checkpoint)
    if config.quantization is not None and config.quantization.get("quant_method") not in (None, "none"):
        raise CheckpointError(
            f"{checkpoint}: quantized checkpoints ({config.quantization.get('quant_method')}) are not loadable yet"
        )
    graphdef, state = nnx.split(abstract_causal_lm(config, dtype))
    expected = parameter_paths(state)
    try:
        files = CheckpointFiles(checkpoint)
    except SafetensorsError as error:
        raise CheckpointError(str(error)) from error
    for path, (name, transform) in _plan(checkpoint, files, config, expected).items():
        variable = expected[path]
        try:
            array = transform(files.read(name))
        except OSError as error:
            raise CheckpointError(f"{checkpoint}: cannot read tensor {name!r}: {error}") from error
        variable.set_value(jax.device_put(np.asarray(array).astype(variable.dtype)))
    return config, nnx.merge(graphdef, state)
