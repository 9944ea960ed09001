"""`python -m inkling_jax.score`: float32 logits of one causal forward over a prompt of token ids, with images.

    python -m inkling_jax.score --checkpoint DIR --input REQ.json --output LOGITS.npy [--dtype float32|bfloat16]

REQ.json is a JSON list of token ids, or `{"prompt_token_ids": [...], "images": ["a.png", ...]}` whose image paths
are relative to REQ.json's directory (or absolute): one image per contiguous run of the model's image placeholder
token, in order, the runs already expanded to one placeholder per 40x40 tile (`inkling_jax.image_processor`
counts them). LOGITS.npy gets float32 [len(ids), unpadded_vocab_size].
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError, ModelConfig
from inkling_jax.forward import logits_fn, multimodal_logits
from inkling_jax.image_processor import ImageError, ImageProcessorSettings
from inkling_jax.model.vision import ImageInputError, placeholder_runs
from inkling_jax.runtime.images import load_images
from inkling_jax.token_ids import TokenIdError, validate_token_ids

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


class ScoreRequestError(ValueError):
    """A REQ.json that cannot be scored; the message names what is wrong."""


def log_to_stderr() -> None:
    """Show inkling_jax's progress lines (e.g. checkpoint bytes vs device bytes) on stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("inkling_jax")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def read_request(path: str | Path) -> tuple[object, object]:
    """(the prompt's ids, the image paths) as REQ.json writes them."""
    path = Path(path)
    try:
        request = json.loads(path.read_text())
    except OSError as error:
        raise ScoreRequestError(f"cannot read {path}: {error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ScoreRequestError(f"{path} is not JSON: {error}") from error
    if isinstance(request, list):
        return request, []
    if not isinstance(request, dict) or "prompt_token_ids" not in request:
        raise ScoreRequestError(f"{path} must hold a list of token ids or an object with 'prompt_token_ids'")
    unknown = sorted(set(request) - {"prompt_token_ids", "images"})
    if unknown:
        raise ScoreRequestError(f"{path}: unknown fields {unknown}; expected 'prompt_token_ids' and 'images'")
    return request["prompt_token_ids"], request.get("images", [])


def request_images(
    ids: list[int], paths: object, directory: Path, config: ModelConfig, settings: ImageProcessorSettings
) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values, image_grid_thw) of the images at `paths` (relative to `directory`), each checked against its
    placeholder run in `ids`."""
    if config.vision is None:
        raise ScoreRequestError("the checkpoint's model takes no images (its config has no vision_config)")
    try:
        images = load_images(paths, directory, settings)
    except ValueError as error:
        raise ScoreRequestError(str(error)) from None
    runs = placeholder_runs(ids, config.image_token_id)
    if len(runs) != len(images):
        raise ScoreRequestError(
            f"the prompt holds {len(runs)} runs of the image placeholder (token {config.image_token_id}) and the "
            f"request names {len(images)} images: one image per run"
        )
    for number, (image, (start, length)) in enumerate(zip(images, runs, strict=True)):
        if image.tiles != length:
            raise ScoreRequestError(
                f"images[{number}] ({paths[number]}) has {image.tiles} tiles, its placeholder run at token {start} "
                f"has {length}"
            )
    pixel_values = np.concatenate([image.pixel_values for image in images])
    return pixel_values, np.concatenate([image.image_grid_thw for image in images])


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("inkling_jax.score", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--input", required=True, help="JSON file: a list of token ids, or ids and images")
    parser.add_argument("--output", required=True, help="where to write the float32 logits (.npy)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="parameter/activation dtype")
    args = parser.parse_args(argv)
    log_to_stderr()
    try:
        ids, paths = read_request(args.input)
        config, model = load_model(args.checkpoint, DTYPES[args.dtype])
        ids = validate_token_ids(ids, config.text)
        if paths or (config.vision is not None and placeholder_runs(ids, config.image_token_id)):
            settings = ImageProcessorSettings.from_checkpoint(args.checkpoint)
            pixel_values, grids = request_images(ids, paths, Path(args.input).parent, config, settings)
            logits = multimodal_logits(model, ids, pixel_values, grids)
        else:
            logits = logits_fn(model)(jnp.asarray([ids], jnp.int32))[0]
    except (ConfigError, CheckpointError, TokenIdError, ScoreRequestError, ImageError, ImageInputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        np.save(args.output, np.asarray(logits, np.float32))
    except OSError as error:
        print(f"error: cannot write {args.output}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
