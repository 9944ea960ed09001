"""Images in requests: what a request carries, the limits it is checked against, where its placeholders go, and
the device program that encodes one image into the engine's feature pool.

A request carries its images processed on the host (`RequestImage`: pixel values and grid, as
`inkling_jax.image_processor` makes them); its prompt holds one run of `image_token_id` placeholders per image,
in order, one placeholder per tile. The engine keeps a pool of feature rows [R, text hidden] on the device; the
scheduler gives a request rows for all its tiles when it is first admitted and keeps them until it finishes (a
preempted request's recomputed prompt reads the same rows), and each image is encoded into its rows by itself,
padded to the smallest of a few fixed tile counts (`image_buckets`), so no image compiles a program and no image's
features depend on the others'. The step reads each placeholder's features from its row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from inkling_jax.config import VisionConfig
from inkling_jax.image_processor import ImageError, ImageProcessorSettings, process_image_file
from inkling_jax.model.vision import placeholder_runs
from inkling_jax.tokenizer import Tokenizer

DEFAULT_MAX_IMAGES = 16  # images per request
DEFAULT_MAX_IMAGE_TILES = 4096  # tiles (image tokens) per image: 2560 x 2560 pixels of 40-pixel tiles
SMALLEST_BUCKET = 16  # tiles of the smallest encode program
IMAGE_MARKER = "<|content_image|>"  # the chat framing's image marker: the placeholder run follows it


class ImageOptionsError(ValueError):
    """Image limits or a feature pool that cannot work (`--max-images`, `--max-image-tiles`,
    `--image-feature-tokens`)."""


@dataclasses.dataclass(frozen=True, eq=False)
class RequestImage:
    """One image of a request: pixel_values float32 [tiles, side, side, channels] and image_grid_thw [1, 3] =
    (1, rows, columns) of tiles, as `inkling_jax.image_processor` makes them."""

    pixel_values: np.ndarray
    image_grid_thw: np.ndarray

    @property
    def tiles(self) -> int:
        return int(self.pixel_values.shape[0])


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What an engine with an image tower takes: tiles of `tile_shape` (side, side, channels), at most `max_images`
    per request and `max_tiles` per image, `pool_rows` feature rows in all (a request's tiles must fit them)."""

    image_token_id: int
    tile_shape: tuple[int, int, int]
    max_images: int
    max_tiles: int
    pool_rows: int


def image_limits(
    vision: VisionConfig | None, image_token_id: int, max_images: int, max_tiles: int, pool_rows: int | None = None
) -> ImageLimits | None:
    """The limits of an engine over a model with the image tower `vision` (None without one, or with `max_images`
    0: an engine that takes no images, so compiles no encode program and keeps no pool); `pool_rows` default: four
    images of `max_tiles`. ImageOptionsError for negative `max_images`, `max_tiles` below one or a pool that cannot
    hold one image."""
    if max_images < 0 or max_tiles < 1:
        raise ImageOptionsError(
            f"max_images ({max_images}) must be at least 0 and max_image_tiles ({max_tiles}) at least 1"
        )
    if vision is None or max_images == 0:
        return None
    rows = default_pool_rows(max_tiles) if pool_rows is None else pool_rows
    if rows < max_tiles:
        raise ImageOptionsError(f"image_feature_tokens {rows} cannot hold one image of max_image_tiles {max_tiles}")
    side = vision.spatial_merge_size * vision.patch_size
    return ImageLimits(image_token_id, (side, side, vision.num_channels), max_images, max_tiles, rows)


def default_pool_rows(max_tiles: int) -> int:
    """The image feature pool's rows unless configured: four images of `max_tiles`."""
    return 4 * max_tiles


def encode_programs_for(requests: Sequence[object], max_tiles: int, pool_rows: int | None = None) -> dict[str, int]:
    """The engine's image options for a known set of requests (each with `images`): no encode program when none
    carries an image, else programs up to its largest image only (never past `max_tiles`: a larger image stays
    refused), over the pool the limits would give (as many images in flight as without this)."""
    tiles = [image.tiles for request in requests for image in request.images]
    if not tiles:
        return {"max_images": 0}
    pool = default_pool_rows(max_tiles) if pool_rows is None else pool_rows
    return {"max_image_tiles": min(max(tiles), max_tiles), "image_feature_tokens": pool}


def image_buckets(max_tiles: int) -> tuple[int, ...]:
    """The tile counts of the encode programs: powers of two from SMALLEST_BUCKET, the last `max_tiles` itself."""
    buckets, size = [], SMALLEST_BUCKET
    while size < max_tiles:
        buckets.append(size)
        size *= 2
    return (*buckets, max_tiles)


def check_images(images: Sequence[object], token_ids: Sequence[int], limits: ImageLimits) -> str | None:
    """What is wrong with a request's images against `limits` and its prompt's placeholder runs, or None: the count,
    each image's shapes, grid and tiles, then one run per image of exactly its tiles, in order."""
    if len(images) > limits.max_images:
        return f"{len(images)} images, more than the {limits.max_images} a request may carry"
    for i, image in enumerate(images):
        if not isinstance(image, RequestImage):
            return f"images[{i}] is not a processed image"
        pixels, grid = np.asarray(image.pixel_values), np.asarray(image.image_grid_thw)
        if pixels.dtype != np.float32 or pixels.ndim != 4 or pixels.shape[1:] != limits.tile_shape:
            return f"images[{i}]: pixel values must be float32 [tiles, {', '.join(map(str, limits.tile_shape))}]"
        if grid.shape != (1, 3) or not np.issubdtype(grid.dtype, np.integer) or grid[0, 0] != 1 or (grid < 1).any():
            return f"images[{i}]: image_grid_thw must be [[1, rows, columns]], got {grid.tolist()}"
        if int(np.prod(grid)) != pixels.shape[0] or pixels.shape[0] == 0:
            return f"images[{i}]: image_grid_thw counts {int(np.prod(grid))} tiles, the pixel values hold {len(pixels)}"
        if pixels.shape[0] > limits.max_tiles:
            return f"images[{i}] has {pixels.shape[0]} tiles, more than the {limits.max_tiles} an image may have"
    runs = [length for _, length in placeholder_runs(token_ids, limits.image_token_id)]
    tiles = [image.tiles for image in images]
    if runs != tiles:
        return (
            f"the prompt's runs of image placeholders (token {limits.image_token_id}) hold {runs} tokens, the "
            f"images have {tiles} tiles: each image needs one contiguous run of one placeholder per tile, in order"
        )
    return None


def load_images(paths: object, directory: Path, settings: ImageProcessorSettings) -> tuple[RequestImage, ...]:
    """The images of a JSONL line's "images" (paths, relative to `directory` or absolute), processed; ValueError
    naming the entry and what is wrong with it."""
    if not isinstance(paths, list) or not all(isinstance(path, str) and path for path in paths):
        raise ValueError("'images' must be a list of image file paths")
    images = []
    for i, path in enumerate(paths):
        try:
            pixels, grid = process_image_file(directory / path, settings)
        except ImageError as error:
            raise ValueError(f"images[{i}] ({path}): {error}") from None
        images.append(RequestImage(pixels, grid))
    return tuple(images)


def expand_after_markers(
    token_ids: Sequence[int], marker_id: int, tiles: Sequence[int], image_token_id: int
) -> list[int]:
    """`token_ids` with each `marker_id` followed by its image's run of placeholders (`tiles[i]` of them for image
    i), in order, as the chat framing places images (`<|content_image|>` then the run, as SMG's Inkling processor
    expands it); ValueError when the markers and the images do not pair up."""
    markers = sum(token == marker_id for token in token_ids)
    if markers != len(tiles):
        raise ValueError(f"the prompt marks {markers} images ({IMAGE_MARKER}), the request has {len(tiles)}")
    expanded, next_run = [], iter(tiles)
    for token in token_ids:
        expanded.append(token)
        if token == marker_id:
            expanded.extend([image_token_id] * next(next_run))
    return expanded


def encode_marked(tokenizer: Tokenizer, text: str, special_tokens: bool = False) -> list[int]:
    """The ids of a text prompt that places images: each `<|content_image|>` marker its token whatever
    `special_tokens` says of the rest of the text (which `Tokenizer.encode` decides). ValueError when the tokenizer
    has no marker token."""
    marker = tokenizer.special_tokens.get(IMAGE_MARKER)
    if marker is None:
        raise ValueError(f"the tokenizer has no {IMAGE_MARKER} token to place images with")
    pieces = [tokenizer.encode(piece, special_tokens=special_tokens) for piece in text.split(IMAGE_MARKER)]
    return [token for i, piece in enumerate(pieces) for token in ([marker] if i else []) + piece]


def encode_fn(
    graphdef: nnx.GraphDef, params: nnx.State, pool: jax.Array, pixels: jax.Array, grid: jax.Array, rows: jax.Array
) -> jax.Array:
    """The pool [R, H] with one image's features written at `rows` [B] (R, past the pool, for padding tiles):
    pixels [B, side, side, C] hold the image's tiles then padding, grid [2, 3] the image's (1, rows, columns) and
    the padding's own image (1, 1, B - tiles), which the tower's per-image attention keeps apart from it (on the
    CPU the real tiles' features are those of the image alone, to the bit)."""
    features = nnx.merge(graphdef, params)(pixels, grid)
    return pool.at[rows].set(features.astype(pool.dtype), mode="drop")


def padded_image(image: RequestImage, bucket: int, rows: np.ndarray, pool_rows: int) -> tuple[np.ndarray, ...]:
    """An image's encode inputs in a bucket of `bucket` tiles: (pixels, grid [2, 3], rows [bucket])."""
    tiles = image.tiles
    pixels = np.zeros((bucket, *image.pixel_values.shape[1:]), np.float32)
    pixels[:tiles] = image.pixel_values
    grid = np.array([np.asarray(image.image_grid_thw)[0], [1, 1, bucket - tiles]], np.int32)
    padded_rows = np.full(bucket, pool_rows, np.int32)
    padded_rows[:tiles] = rows
    return pixels, grid, padded_rows
