"""Synthetic Inkling 2 checkpoints: random weights for any config, plain or with quantized experts.

    python -m inkling_jax.checkpoint.synthetic --config CONFIG --out DIR
        [--experts bf16|mxfp8|mixed] [--nvfp4-layers A-B] [--layout original|transformers] [--seed 0]
        [--draft-config DSPARK_CONFIG.json]

Every parameter gets non-trivial values at a realistic scale (including those the reference
initialises to zeros or ones: attention-residual queries, clip scales, norm gains, correction bias,
dynamic static taps), so a checkpoint exercises every path of the model and activations stay finite.
Tensors are generated and written one at a time (experts one expert at a time), so host memory stays
at one expert's weight whatever the model size. Quantized experts follow the released checkpoints:
original layout, interleaved gate/up rows, ModelOpt sidecar names, NVFP4 with one global scale per expert.
A config with a `dspark_config` (in the file, or added with `draft` / `--draft-config`) gets a random DSpark
draft too (`dspark.*` tensors, the same names in both layouts), and one with a `vision_config` a random image tower
(`model.visual.*` in the original layout, `model.vision_tower.*` in transformers'), never quantized, and a
preprocessor_config.json (transformers' `Inkling2ImageProcessor` settings, tiles of the tower's size).
A tokenizer (tokenizer.json, tokenizer_config.json; see `synthetic_tokenizer`) comes with every config whose
vocabulary can hold one; smaller ones (like the unit tests' 60-token models) get none, with a logged warning.
"""

from __future__ import annotations

import argparse
import json
import logging
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from inkling_jax.checkpoint.loader import checkpoint_parameters
from inkling_jax.checkpoint.names import (
    TRANSFORMERS,
    interleave_rows,
    is_vision_path,
    original_name,
    vision_checkpoint_name,
)
from inkling_jax.checkpoint.safetensors_io import TensorSpec, split_by_bytes, write_sharded_streamed
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer, write_tokenizer
from inkling_jax.cli import argument_parser
from inkling_jax.config import DRAFT_SECTION, ModelConfig, VisionConfig, parse_config
from inkling_jax.image_processor import PREPROCESSOR_CONFIG
from inkling_jax.tokenizer import TokenizerError
from pallas_kernels import block_formats
from pallas_kernels.quantized import MXFP8, NVFP4

EXPERT_CHOICES = ("bf16", "fp32", MXFP8, "mixed")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

logger = logging.getLogger(__name__)


def expert_formats(config: ModelConfig, experts: str, nvfp4_layers: range | None) -> list[str | None]:
    """Per layer: None (plain), "mxfp8" or "nvfp4". "mixed" defaults to NVFP4 on the first 5/6 of the
    layers and MXFP8 on the rest, like the native release (NVFP4 0-39, MXFP8 40-47)."""
    layers = config.text.num_hidden_layers
    if experts in ("bf16", "fp32"):
        return [None] * layers
    if experts == MXFP8:
        return [MXFP8] * layers
    nvfp4 = nvfp4_layers if nvfp4_layers is not None else range(layers * 5 // 6)
    return [NVFP4 if layer in nvfp4 else MXFP8 for layer in range(layers)]


def _values(path: str, shape: tuple[int, ...], seed: int, std: float) -> np.ndarray:
    """Random float32 values for one parameter (or one expert's slice of it), reproducible by name."""
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    if path.endswith((".query", ".static_weight", ".e_score_correction_bias")):
        return rng.normal(0.0, 0.5, shape).astype(F32)
    if path.endswith(("norm.weight", "l2_clip.scale", "layernorm_before.weight", "layernorm_after.weight")):
        return rng.uniform(0.5, 1.5, shape).astype(F32)
    if path.endswith((".lambda_1", ".lambda_2")):  # the image tower's layer scales
        return rng.uniform(0.05, 0.3, shape).astype(F32)
        return rng.uniform(0.5, 1.5, shape).astype(F32)
    if path.endswith(".conv1d.weight"):
        return rng.normal(0.0, 0.3, shape).astype(F32)
    if path == "model.embed_tokens.weight":
        return rng.normal(0.0, 1.0, shape).astype(F32)
    return rng.normal(0.0, std, shape).astype(F32)


class _Writer:
    """The tensor specs of one synthetic checkpoint, and the chunks that fill them."""

    def __init__(self, config: ModelConfig, formats: list[str | None], dtype: np.dtype, layout: str, seed: int):
        self.shapes = {path: tuple(var.shape) for path, var in checkpoint_parameters(config, jnp.float32).items()}
        self.formats, self.dtype, self.layout, self.seed = formats, dtype, layout, seed
        self.std = config.text.initializer_range
        self.sources: dict[str, tuple[str, str]] = {}  # checkpoint name -> (parameter path, role)
        self.specs: list[TensorSpec] = []
        for path, shape in self.shapes.items():
            format = self._format(path)
            if format is None:
                kept_fp32 = path.endswith("e_score_correction_bias")  # fp32 in the releases too
                self._add(self._name(path), path, "plain", F32 if kept_fp32 else self.dtype, shape)
                continue
            name = self._name(path)
            packed = shape[-1] // 2 if format == NVFP4 else shape[-1]
            block = block_formats.NV_BLOCK if format == NVFP4 else block_formats.MX_BLOCK
            data_dtype = np.dtype(np.uint8) if format == NVFP4 else block_formats.E4M3
            scale_dtype = block_formats.E4M3 if format == NVFP4 else np.dtype(np.uint8)
            self._add(name, path, "data", data_dtype, (*shape[:-1], packed))
            self._add(f"{name}_scale", path, "scales", scale_dtype, (*shape[:-1], shape[-1] // block))
            if format == NVFP4:
                self._add(f"{name}_scale_2", path, "global_scale", F32, (shape[0],))

    def _format(self, path: str) -> str | None:
        if ".mlp.experts." not in path:
            return None
        return self.formats[int(path.split(".")[2])]

    def _name(self, path: str) -> str:
        if self.layout == "original":
            return original_name(path)
        return vision_checkpoint_name(path, TRANSFORMERS) if is_vision_path(path) else path

    def _add(self, name: str, path: str, role: str, dtype: np.dtype, shape: tuple[int, ...]) -> None:
        self.sources[name] = (path, role)
        self.specs.append(TensorSpec(name, dtype, shape))

    def chunks(self, spec: TensorSpec) -> Iterator[np.ndarray]:
        path, role = self.sources[spec.name]
        shape = self.shapes[path]
        if role == "plain":
            values = _values(path, shape, self.seed, self.std)
            if self.layout == "original" and path.endswith("gate_up_proj"):
                values = interleave_rows(values)
            yield values.astype(spec.dtype)
            return
        format = self._format(path)
        for expert in range(shape[0]):  # one expert at a time: host memory stays at one [N, K] slice
            values = _values(f"{path}[{expert}]", shape[1:], self.seed, self.std)
            if format == MXFP8:
                data, scales = block_formats.mxfp8_encode(values)
                global_scale = None
            else:
                data, scales, global_scale = block_formats.nvfp4_encode(values)
            part = {"data": data, "scales": scales, "global_scale": global_scale}[role]
            if role != "global_scale" and self.layout == "original" and path.endswith("gate_up_proj"):
                part = interleave_rows(part[None])[0]
            yield np.asarray(part).reshape(-1 if role == "global_scale" else part.shape)


def write_checkpoint(
    config_path: str | Path,
    out: str | Path,
    *,
    seed: int = 0,
    experts: str = "bf16",
    nvfp4_layers: range | None = None,
    layout: str = "original",
    shard_bytes: int = 2 << 30,
    draft: Mapping | None = None,
    weights: bool = True,
) -> Path:
    """Write config.json, the synthetic tokenizer and random weights for the config at `config_path` to
    directory `out`; `draft`: a `dspark_config` to add (replacing the file's), for a random DSpark draft.
    `weights=False` writes no weights: a directory `--load-format dummy` serves text from, at any size."""
    if experts not in EXPERT_CHOICES:
        raise ValueError(f"--experts must be one of {EXPERT_CHOICES}, got {experts!r}")
    raw = json.loads(Path(config_path).read_text())
    if draft is not None:
        raw[DRAFT_SECTION] = dict(draft)
    config = parse_config(raw)
    formats = expert_formats(config, experts, nvfp4_layers)
    dtype = F32 if experts == "fp32" else BF16
    writer = _Writer(config, formats, dtype, layout, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(formats):
        raw["quantization_config"] = _quantization_config(formats, layout)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    _write_tokenizer(out, config)
    if config.vision is not None:
        _write_image_processor(out, config.vision)
    if weights:
        write_sharded_streamed(out, split_by_bytes(writer.specs, shard_bytes), writer.chunks)
    return out


def _write_tokenizer(out: Path, config: ModelConfig) -> None:
    """The synthetic tokenizer, when the config's vocabulary can hold one."""
    try:
        tokenizer = build_tokenizer(config.text, config.image_token_id if config.vision is not None else None)
    except TokenizerError as error:
        logger.warning("%s gets no tokenizer: %s", out, error)
        return
    write_tokenizer(out, tokenizer)


def _write_image_processor(out: Path, vision: VisionConfig) -> None:
    """transformers' image processor settings with its defaults, and tiles of the tower's (merged patches) size."""
    side = vision.patch_size * vision.spatial_merge_size
    settings = {
        "image_processor_type": "Inkling2ImageProcessor",
        "do_convert_rgb": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"height": side, "width": side},
    }
    (out / PREPROCESSOR_CONFIG).write_text(json.dumps(settings, indent=2))


def _quantization_config(formats: list[str | None], layout: str) -> dict:
    prefix = "model.llm" if layout == "original" else "model"
    algos = {MXFP8: {"quant_algo": "MXFP8"}, NVFP4: {"quant_algo": "NVFP4", "group_size": 16}}
    return {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {
            f"{prefix}.layers.{layer}.mlp.experts": algos[format] for layer, format in enumerate(formats) if format
        },
    }


def _layer_range(text: str) -> range:
    first, _, last = text.partition("-")
    try:
        return range(int(first), int(last or first) + 1)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a layer range like 0-39, got {text!r}") from error


def main(argv: list[str] | None = None) -> None:
    """`python -m inkling_jax.checkpoint.synthetic` (`inkling-synthetic`): write one and print its directory."""
    parser = argument_parser("inkling_jax.checkpoint.synthetic", "Write a random Inkling 2 checkpoint for a config")
    parser.add_argument("--config", required=True, help="config.json describing the model")
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--experts", choices=EXPERT_CHOICES, default="bf16", help="how routed experts are stored")
    parser.add_argument("--nvfp4-layers", type=_layer_range, help="with --experts mixed: NVFP4 layers, e.g. 0-39")
    layout_help = "tensor names: a hub release's or transformers' module names"
    parser.add_argument("--layout", choices=("original", "transformers"), default="original", help=layout_help)
    parser.add_argument("--seed", type=int, default=0, help="random seed of every tensor")
    parser.add_argument("--shard-gib", type=float, default=2.0, help="approximate shard size")
    parser.add_argument("--draft-config", type=Path, help="a dspark_config JSON object: add a random DSpark draft")
    no_weights_help = "config and tokenizer only: a directory --load-format dummy serves text from"
    parser.add_argument("--no-weights", dest="weights", action="store_false", help=no_weights_help)
    args = parser.parse_args(argv)
    draft = json.loads(args.draft_config.read_text()) if args.draft_config else None
    out = write_checkpoint(
        args.config,
        args.out,
        seed=args.seed,
        experts=args.experts,
        nvfp4_layers=args.nvfp4_layers,
        layout=args.layout,
        shard_bytes=int(args.shard_gib * 2**30),
        draft=draft,
        weights=args.weights,
    )
    print(out)


if __name__ == "__main__":
    main()
