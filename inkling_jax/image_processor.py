"""`python -m inkling_jax.image_processor`: an encoded image to the vision tower's input, as transformers makes it.

    python -m inkling_jax.image_processor --checkpoint DIR --image PATH --output OUT.npz [--max-pixels N]

OUT.npz gets `pixel_values` float32 [tiles, 40, 40, 3] and `image_grid_thw` int64 [1, 3] = (1, rows, cols), equal
bit for bit to what transformers 5.23's `Inkling2ImageProcessor` gives for the image opened with Pillow:

- no resize: one 40x40 tile, one image token, per started 40x40 block: tokens = ceil(H / 40) * ceil(W / 40);
- an image with transparency (an alpha channel, a transparent palette entry, a tRNS colour) is composited over a
  grey checkerboard of 8-pixel squares (204 and 153) in integers, rounding to nearest; any other image becomes RGB
  by Pillow's conversion (grey copied to the three channels, a palette looked up);
- padding right and bottom to whole tiles with -1 on the 0-255 scale, then normalisation in float32 as
  (x - mean / rescale_factor) / (std / rescale_factor): (x - 127.5) / 127.5 with the default settings;
- tiles in raster order, channels last.

Like transformers' processor given an opened image, this applies no EXIF orientation and takes an animated image's
first frame. (transformers' loader for image URLs and paths in chat messages, `load_image`, does apply the EXIF
orientation, and converts to RGB, dropping alpha, before the processor sees the image.) SMG's Rust Inkling processor
(`crates/multimodal/src/vision/processors/inkling.rs`) is not this one: it drops alpha without compositing, adds a
tile column to every row (W // 40 + 1 columns), repeats each tile twice in time, defaults to CLIP's mean and std and
normalises in a fused form that rounds differently: its pixel values and token counts do not fit this model as
transformers runs it.

The settings are the checkpoint's, found where transformers looks for them: the `image_processor` object of
`processor_config.json`, else `preprocessor_config.json`, else transformers' defaults. `max_pixels` is ours: the
largest width x height accepted. Images are PNG, JPEG, WebP or GIF; the format, the size and the pixel limit are
checked on the header alone, before any pixel is decoded. What is wrong with an image raises ImageError naming it.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import struct
import sys
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from inkling_jax.cli import argument_parser
from inkling_jax.config import ConfigError

logger = logging.getLogger(__name__)

PROCESSOR_CONFIG = "processor_config.json"  # transformers' unified processor file: settings under "image_processor"
PREPROCESSOR_CONFIG = "preprocessor_config.json"
DEFAULT_MAX_PIXELS = 8192 * 8192  # 42,025 image tokens; 0.8 GB of float32 pixel values

# Pillow's name of each accepted format -> the media types naming it
FORMATS = {
    "PNG": ("image/png",),
    "JPEG": ("image/jpeg", "image/jpg"),
    "WEBP": ("image/webp",),
    "GIF": ("image/gif",),
}
MEDIA_TYPES = {media_type: name for name, types in FORMATS.items() for media_type in types}
_FORMAT_LIST = "PNG, JPEG, WebP or GIF"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# What Pillow raises on bytes its decoders cannot read (its own identification catches the same kinds).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error, zlib.error)

# transformers' fields we read; the others (image_processor_type, do_resize, ...) change nothing it computes
_FIELDS = ("do_convert_rgb", "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std", "size")


class ImageError(ValueError):
    """An image that cannot be processed; the message says what is wrong with it."""


@dataclasses.dataclass(frozen=True)
class ImageProcessorSettings:
    """How images become pixel values. Defaults are transformers' `Inkling2ImageProcessor` defaults, with our limit."""

    tile_height: int = 40  # transformers' `size`: one image token's block of pixels
    tile_width: int = 40
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.max_pixels < 1:
            raise ConfigError(f"max_pixels must be a positive number of pixels, got {self.max_pixels}")

    @classmethod
    def from_dict(cls, fields: Mapping[str, Any], max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageProcessorSettings:
        """Settings from a transformers image processor config; ConfigError names a field holding a bad value (null
        included: transformers reads it as false or fails, never as the default)."""
        unused = sorted(set(fields) - set(_FIELDS))
        if unused:
            logger.debug("image processor fields not used: %s", ", ".join(unused))
        if not _boolean(fields, "do_convert_rgb", True):
            raise ConfigError("do_convert_rgb: false is not supported (the vision tower takes RGB images)")
        do_rescale, do_normalize = _boolean(fields, "do_rescale", True), _boolean(fields, "do_normalize", True)
        rescale_factor = _number(fields.get("rescale_factor", 1 / 255), "rescale_factor")
        if do_rescale and not (math.isfinite(rescale_factor) and rescale_factor > 0):
            raise ConfigError(f"rescale_factor must be positive and finite, got {rescale_factor}")
        image_mean = _per_channel(fields.get("image_mean", 0.5), "image_mean")
        image_std = _per_channel(fields.get("image_std", 0.5), "image_std")
        if do_normalize and not all(math.isfinite(v) for v in image_mean):
            raise ConfigError(f"image_mean must be finite, got {list(image_mean)}")
        if do_normalize and not all(math.isfinite(v) and v != 0 for v in image_std):
            raise ConfigError(f"image_std must be finite and nonzero, got {list(image_std)}")
        tile_height, tile_width = _tile_size(fields.get("size", 40))
        return cls(tile_height, tile_width, do_rescale, rescale_factor, do_normalize, image_mean, image_std, max_pixels)

    @classmethod
    def from_checkpoint(cls, path: str | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> ImageProcessorSettings:
        """The settings of a checkpoint directory; defaults for one without them, or for a bare config file (what
        a dummy checkpoint may be). ConfigError, naming the file, for a missing path or a bad settings file."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"checkpoint {path} does not exist")
        if not path.is_dir():
            return cls(max_pixels=max_pixels)
        source = path / PROCESSOR_CONFIG
        fields = _read_json(source).get("image_processor")
        if not isinstance(fields, dict):
            source = path / PREPROCESSOR_CONFIG
            fields = _read_json(source)
        try:
            settings = cls.from_dict(fields)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from error
        return dataclasses.replace(settings, max_pixels=max_pixels)


@dataclasses.dataclass(frozen=True)
class ImageHeader:
    """What an image's header says: Pillow's format name and the size in pixels."""

    format: str
    width: int
    height: int


DEFAULTS = ImageProcessorSettings()


def grid_shape(height: int, width: int, settings: ImageProcessorSettings = DEFAULTS) -> tuple[int, int]:
    """(rows, cols) of tiles covering a height x width image: partial tiles at the right and bottom count."""
    return -(-height // settings.tile_height), -(-width // settings.tile_width)


def image_token_count(height: int, width: int, settings: ImageProcessorSettings = DEFAULTS) -> int:
    """Image tokens (tiles) the model gets for a height x width image; no pixel needs decoding."""
    rows, cols = grid_shape(height, width, settings)
    return rows * cols


def read_header(data: bytes, settings: ImageProcessorSettings = DEFAULTS, media_type: str | None = None) -> ImageHeader:
    """The format and size of an encoded image, checked against the accepted formats and `settings.max_pixels`
    without decoding pixels. ImageError names what is wrong."""
    image = _open(data, media_type)
    _check_size(image.width, image.height, settings)
    return ImageHeader(image.format, image.width, image.height)


def process_image_bytes(
    data: bytes, settings: ImageProcessorSettings = DEFAULTS, media_type: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values float32 [tiles, tile_height, tile_width, 3], image_grid_thw int64 [1, 3]) of an encoded image.

    `media_type` (e.g. "image/png"), when given, must name an accepted format; the bytes decide the decoder, as
    clients often label an image with the wrong one of them. ImageError, before decoding where the header shows it,
    for an unsupported format, a zero-size image or one above `settings.max_pixels`; after, for corrupt pixel data.
    """
    image = _open(data, media_type)
    _check_size(image.width, image.height, settings)
    return pixel_values(_decode_rgb(image), settings)


def process_image_file(path: str | Path, settings: ImageProcessorSettings = DEFAULTS) -> tuple[np.ndarray, np.ndarray]:
    """`process_image_bytes` of a file's bytes; ImageError for a file that cannot be read."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ImageError(f"cannot read image file {path}: {error.strerror or error}") from error
    return process_image_bytes(data, settings)


def composite_on_checkerboard(rgba: np.ndarray) -> np.ndarray:
    """uint8 RGB of uint8 RGBA [H, W, 4] laid over a checkerboard of 8-pixel squares, 204 where the square's row and
    column add up even, else 153: (rgb * a + background * (255 - a) + 127) // 255 in integers."""
    rows = np.arange(rgba.shape[0], dtype=np.int32)[:, None] // 8
    cols = np.arange(rgba.shape[1], dtype=np.int32)[None, :] // 8
    background = np.where((rows + cols) % 2 == 0, np.int32(204), np.int32(153))[..., None]
    alpha = rgba[..., 3:].astype(np.int32)  # int32 throughout and in place: a few times faster on large images
    mixed = rgba[..., :3].astype(np.int32)
    mixed *= alpha
    mixed += background * (255 - alpha)
    mixed += 127
    mixed //= 255
    return mixed.astype(np.uint8)


def pixel_values(rgb: np.ndarray, settings: ImageProcessorSettings = DEFAULTS) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values, image_grid_thw) of a uint8 RGB image [H, W, 3]: padded with -1 to whole tiles, normalised in
    float32 in transformers' order of operations, cut into tiles in raster order."""
    height, width, channels = rgb.shape
    rows, cols = grid_shape(height, width, settings)
    th, tw = settings.tile_height, settings.tile_width
    canvas = np.full((rows * th, cols * tw, channels), -1, np.float32)
    canvas[:height, :width] = rgb
    values = _normalise_in_place(canvas, settings)
    tiles = values.reshape(rows, th, cols, tw, channels).transpose(0, 2, 1, 3, 4).reshape(rows * cols, th, tw, channels)
    return np.ascontiguousarray(tiles), np.array([[1, rows, cols]], np.int64)


def _normalise_in_place(x: np.ndarray, settings: ImageProcessorSettings) -> np.ndarray:
    """float32 `x` normalised with transformers' arithmetic: with both steps on, mean and std are first divided by
    the rescale factor (as float32 products with the float32 of 1 / factor) and x - mean is divided by std; rescaling
    alone is a float32 product."""
    mean, std = np.asarray(settings.image_mean, np.float32), np.asarray(settings.image_std, np.float32)
    if settings.do_normalize:
        if settings.do_rescale:
            scale = np.float32(1.0 / settings.rescale_factor)
            mean, std = mean * scale, std * scale
        np.subtract(x, mean, out=x)
        np.divide(x, std, out=x)
    elif settings.do_rescale:
        np.multiply(x, np.float32(settings.rescale_factor), out=x)
    return x


def _open(data: bytes, media_type: str | None) -> Image.Image:
    """The image in `data` with only its header read, by the first accepted format's decoder that knows it."""
    if media_type is not None and _media_type(media_type) not in MEDIA_TYPES:
        raise ImageError(f"media type {media_type!r} is not supported; images are {_FORMAT_LIST}")
    if not data:
        raise ImageError("image is empty (0 bytes)")
    _check_png_size(data)
    prefix = bytes(data[:16])
    Image.init()
    for name in FORMATS:
        factory, accept = Image.OPEN[name]
        known = accept(prefix)
        if isinstance(known, str):  # the format, but this Pillow was built without its decoder
            raise ImageError(f"cannot decode {_display(name)} images here: {known}")
        if not known:
            continue
        try:
            # the decoder's own class rather than Image.open, whose pixel check would refuse large images with
            # Pillow's limit and without their size
            return factory(io.BytesIO(data), "")
        except Image.DecompressionBombError as error:
            raise ImageError(f"image is too large for the decoder: {error}") from error
        except _DECODE_ERRORS as error:
            raise ImageError(f"not a valid {_display(name)} image: {error}") from error
    other = [name for name, (_, accept) in Image.OPEN.items() if accept and _accepts(accept(prefix))]
    found = f"a {other[0]} image" if other else "not an image format we know"
    raise ImageError(f"unsupported image format ({found}); images are {_FORMAT_LIST}")


def _accepts(known: bool | str) -> bool:
    """Whether a Pillow format's `accept` says yes (a string says yes, but that the decoder is missing)."""
    return bool(known) and not isinstance(known, str)


def _check_png_size(data: bytes) -> None:
    """A PNG header's zero width or height named as such (Pillow's PNG decoder only says it cannot identify it)."""
    if data[:8] == _PNG_SIGNATURE and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        if width == 0 or height == 0:
            raise ImageError(f"image is {width}x{height}: zero size")


def _check_size(width: int, height: int, settings: ImageProcessorSettings) -> None:
    if width == 0 or height == 0:
        raise ImageError(f"image is {width}x{height}: zero size")
    if width * height > settings.max_pixels:
        raise ImageError(
            f"image is {width}x{height} = {width * height} pixels, above the limit of {settings.max_pixels}"
        )


def _decode_rgb(image: Image.Image) -> np.ndarray:
    """uint8 RGB [H, W, 3] of an opened image: Pillow decodes and converts it as transformers has it do (RGBA when
    the image has transparency, then composited; RGB otherwise)."""
    transparent = image.has_transparency_data  # asked before decoding, as transformers asks
    try:
        image.load()
    except _DECODE_ERRORS as error:
        raise ImageError(f"corrupt {_display(image.format)} image data: {error}") from error
    try:
        converted = image.convert("RGBA" if transparent else "RGB")
    except ValueError as error:
        raise ImageError(f"image mode {image.mode} cannot be converted to RGB: {error}") from error
    array = np.asarray(converted)
    return composite_on_checkerboard(array) if transparent else array


def _media_type(value: str) -> str:
    """`value` without parameters and case: "Image/PNG; q=1" -> "image/png"."""
    return value.split(";", 1)[0].strip().lower()


def _display(name: str | None) -> str:
    return {"WEBP": "WebP"}.get(name or "", name or "image")


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, {} when there is no such file; ConfigError for one unreadable or not an object."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def _boolean(fields: Mapping[str, Any], name: str, default: bool) -> bool:
    value = fields.get(name, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)


def _per_channel(value: Any, name: str) -> tuple[float, float, float]:
    """One number for all three channels, or one each (transformers accepts both, and a list of one)."""
    values = value if isinstance(value, list | tuple) else [value]
    if len(values) not in (1, 3):
        raise ConfigError(f"{name} must be a number or a list of 1 or 3 numbers, got {value!r}")
    numbers = [_number(v, name) for v in values]
    return (numbers[0],) * 3 if len(numbers) == 1 else (numbers[0], numbers[1], numbers[2])


def _tile_size(value: Any) -> tuple[int, int]:
    """(height, width) from transformers' `size`: {"height": h, "width": w}, [h, w], or one integer for a square."""
    if isinstance(value, dict):
        sides = value.get("height"), value.get("width")
    elif isinstance(value, list | tuple) and len(value) == 2:
        sides = tuple(value)
    else:
        sides = value, value
    if not all(isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in sides):
        raise ConfigError(
            f"size must be {{'height': h, 'width': w}}, [h, w] or one integer, all positive, got {value!r}"
        )
    return sides


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("inkling_jax.image_processor", __doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (its preprocessor settings)")
    parser.add_argument("--image", required=True, help="PNG, JPEG, WebP or GIF file")
    parser.add_argument("--output", required=True, help="where to write pixel_values and image_grid_thw (.npz)")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="largest width x height accepted")
    args = parser.parse_args(argv)
    try:
        settings = ImageProcessorSettings.from_checkpoint(args.checkpoint, args.max_pixels)
        values, grid = process_image_file(args.image, settings)
    except (ConfigError, ImageError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        np.savez(args.output, pixel_values=values, image_grid_thw=grid)
    except OSError as error:
        print(f"error: cannot write {args.output}: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
