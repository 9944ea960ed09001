"""Quantized experts in checkpoints: the format of each expert weight, decided from its tensors.

An expert weight (w13 / w2, or gate_up_proj / down_proj) is stored as
- plain: one float tensor;
- MXFP8: F8_E4M3 (or U8) data [E, N, K] with U8 / F8_E8M0 scales [E, N, K / 32], no global scale;
- NVFP4: U8 data [E, N, K / 2] (two codes per byte) with F8_E4M3 scales [E, N, K / 16] and an F32
  global scale per expert ([E], [E, 1] or one for all).
Anything else, a missing sidecar or a mis-shaped one raises CheckpointError naming the tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from inkling_jax.checkpoint.errors import CheckpointError
from inkling_jax.checkpoint.finite import non_finite_message
from inkling_jax.checkpoint.names import DATA, GLOBAL_SCALE, SCALES
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles
from pallas_kernels.block_formats import MX_BLOCK, NV_BLOCK
from pallas_kernels.quantized import MXFP8, NVFP4

FLOAT_DTYPES = tuple(np.dtype(d) for d in (np.float32, np.float16, np.float64, ml_dtypes.bfloat16))
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
U8 = np.dtype(np.uint8)


def expert_format(
    checkpoint: Path, files: CheckpointFiles, tensors: Mapping[str, str], shape: tuple[int, ...]
) -> str | None:
    """None (plain), MXFP8 or NVFP4 for the expert weight made of `tensors` (role -> tensor name),
    whose logical shape is `shape` [E, N, K]."""
    data_name = tensors[DATA]
    data = files.entry(data_name)
    scale_name, global_name = tensors.get(SCALES), tensors.get(GLOBAL_SCALE)
    width = shape[-1]
    if data.dtype in FLOAT_DTYPES:
        if scale_name or global_name:
            raise CheckpointError(f"{checkpoint}: {data_name!r} is {data.dtype} but has quantization sidecars")
        return None
    if data.dtype == E4M3 or (data.dtype == U8 and data.shape[-1] == width):
        format, block, scale_dtypes = MXFP8, MX_BLOCK, (U8, E8M0)
    elif data.dtype == U8 and data.shape[-1] * 2 == width:
        format, block, scale_dtypes = NVFP4, NV_BLOCK, (E4M3,)
    else:
        raise CheckpointError(
            f"{checkpoint}: {data_name!r} ({data.dtype} {data.shape}) is no known expert format for a "
            f"weight of shape {tuple(shape)} (plain float, MXFP8 E4M3/U8 [.., {width}], NVFP4 U8 [.., {width // 2}])"
        )
    stored = (*shape[:-1], width if format == MXFP8 else width // 2)
    if data.shape != stored:
        raise CheckpointError(f"{checkpoint}: {data_name!r} has shape {data.shape}, the config needs {stored}")
    if scale_name is None:
        raise CheckpointError(f"{checkpoint}: {data_name!r} holds {format} data but its block-scale sidecar is missing")
    scales = files.entry(scale_name)
    if width % block or scales.shape != (*shape[:-1], width // block):
        raise CheckpointError(
            f"{checkpoint}: {format} scale {scale_name!r} has shape {scales.shape}, "
            f"expected {(*shape[:-1], width // block)} (one per {block} inputs)"
        )
    if scales.dtype not in scale_dtypes:
        raise CheckpointError(f"{checkpoint}: {format} scale {scale_name!r} has dtype {scales.dtype}")
    if format == MXFP8 and global_name is not None:
        raise CheckpointError(f"{checkpoint}: MXFP8 weight {data_name!r} has an unexpected global scale")
    if format == NVFP4:
        if global_name is None:
            raise CheckpointError(f"{checkpoint}: NVFP4 weight {data_name!r} has no global scale (`_scale_2`)")
        global_scale = files.entry(global_name)
        if global_scale.shape not in ((), (1,), (shape[0],), (shape[0], 1), (shape[0], 1, 1)):
            raise CheckpointError(
                f"{checkpoint}: global scale {global_name!r} has shape {global_scale.shape}, expected one per expert"
            )
        if global_scale.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{checkpoint}: global scale {global_name!r} has dtype {global_scale.dtype}")
    return format


def per_expert(global_scale: np.ndarray, experts: int) -> np.ndarray:
    """A global scale stored as one value, [E], [E, 1] or [E, 1, 1] as the parameter's [E, 1, 1]: a
    broadcast view, so slicing it reads only the experts asked for."""
    return np.broadcast_to(global_scale.reshape(-1, 1, 1), (experts, 1, 1))


def check_global_scale(checkpoint: Path, name: str, global_scale: np.ndarray) -> None:
    """A stored global scale, read whole (one value per expert, or one for all), must be finite and positive:
    checked here rather than on device (`finite`), where a value stored once for all experts would count once
    per expert."""
    values = np.asarray(global_scale, np.float32)
    non_finite = int(np.count_nonzero(~np.isfinite(values)))
    if non_finite:
        raise CheckpointError(non_finite_message(str(checkpoint), [(name, non_finite)]))
    if not (values > 0).all():
        raise CheckpointError(f"{checkpoint}: global scale {name!r} must be finite and positive")


def stored_array(role: str, format: str, array: np.ndarray) -> np.ndarray:
    """A quantized weight's tensor (or a slice of it) as its parameter holds it: MXFP8 values as E4M3 and their
    scales as E8M0 bytes (uint8), whichever of the two the checkpoint stores them as; a global scale (as
    `per_expert` gives it, checked by `check_global_scale`) as float32. Block scales and values are checked for
    NaN on device once placed (`finite`)."""
    if role == DATA:
        return array.view(E4M3) if format == MXFP8 else array
    if role == SCALES:
        return array.view(U8) if format == MXFP8 else array
    return np.asarray(array, np.float32)


_QUANT_ALGOS = {"NVFP4": NVFP4, "MXFP8": MXFP8}


def check_quantization_config(
    checkpoint: Path, quantization: Mapping | None, formats: Mapping[int, str | None]
) -> None:
    """A `quantization_config` in config.json must describe the experts the tensors hold."""
    if quantization is None:
        return
    method = quantization.get("quant_method")
    quantized = {layer: f for layer, f in formats.items() if f is not None}
    if method == "fp8":
        allowed = {MXFP8}
        if quantization.get("weight_block_size") not in (None, [1, 32]):
            raise CheckpointError(
                f"{checkpoint}: quantization_config weight_block_size {quantization.get('weight_block_size')} "
                "is not MXFP8's [1, 32]"
            )
    elif method == "modelopt":
        algo = quantization.get("quant_algo")
        if algo == "MIXED_PRECISION":
            allowed = {MXFP8, NVFP4}
            for module, spec in (quantization.get("quantized_layers") or {}).items():
                layer = _layer_of(module)
                want = _QUANT_ALGOS.get(spec.get("quant_algo")) if isinstance(spec, dict) else None
                if layer is not None and layer in formats and formats[layer] != want:
                    raise CheckpointError(
                        f"{checkpoint}: quantization_config says {module} is {spec}, the tensors hold "
                        f"{formats[layer] or 'unquantized'} experts"
                    )
        elif algo in _QUANT_ALGOS:
            allowed = {_QUANT_ALGOS[algo]}
        else:
            raise CheckpointError(f"{checkpoint}: quantization_config quant_algo {algo!r} is not supported")
    else:
        raise CheckpointError(
            f"{checkpoint}: quantization_config quant_method {method!r} is not supported ('fp8' or 'modelopt')"
        )
    if not quantized:
        raise CheckpointError(f"{checkpoint}: quantization_config says {method}, but no expert tensor is quantized")
    for layer, format in sorted(quantized.items()):
        if format not in allowed:
            raise CheckpointError(
                f"{checkpoint}: layer {layer} holds {format} experts, "
                f"which quantization_config ({method}) does not allow"
            )


def configured_expert_formats(source: str, quantization: Mapping | None, layers: int) -> list[str | None]:
    """Each layer's expert format (None for plain) as a config's `quantization_config` states it, for a model
    built from its config alone: none, `fp8` (MXFP8 everywhere), `modelopt` NVFP4 / MXFP8 everywhere, or
    `modelopt` MIXED_PRECISION per layer from `quantized_layers` (layers it does not list stay plain)."""
    if quantization is None:
        return [None] * layers
    method, algo = quantization.get("quant_method"), quantization.get("quant_algo")
    if method == "fp8":
        check_quantization_config(Path(source), quantization, dict.fromkeys(range(layers), MXFP8))
        return [MXFP8] * layers
    if method == "modelopt" and algo in _QUANT_ALGOS:
        return [_QUANT_ALGOS[algo]] * layers
    if method != "modelopt" or algo != "MIXED_PRECISION":
        check_quantization_config(Path(source), quantization, {})  # names the unsupported method or algorithm
    formats: list[str | None] = [None] * layers
    for module, spec in (quantization.get("quantized_layers") or {}).items():
        layer = _layer_of(module)
        format = _QUANT_ALGOS.get(spec.get("quant_algo")) if isinstance(spec, dict) else None
        if format is None:
            raise CheckpointError(f"{source}: quantization_config says {module} is {spec}, not NVFP4 or MXFP8")
        if layer is None or layer >= layers:
            raise CheckpointError(f"{source}: quantization_config names {module}, which is no layer of the model")
        formats[layer] = format
    if not any(formats):
        raise CheckpointError(f"{source}: quantization_config says MIXED_PRECISION but lists no quantized layer")
    return formats


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    for before, after in itertools.pairwise(parts):
        if before == "layers" and after.isdigit():
            return int(after)
    return None
