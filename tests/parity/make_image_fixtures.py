"""Build the image processor's parity fixtures: encoded images and transformers' pixel values for each.

Runs against the reference stack (transformers 5.23.0's `Inkling2ImageProcessor` on torch 2.13.0 CPU, torchvision,
Pillow) and never imports ``inkling_jax``. It writes ``tests/fixtures/images/``:

* one file per case: PNG (RGB, RGBA, grey, grey + alpha, palette, palette with one transparent entry and with an
  alpha per entry, RGB and grey with a tRNS colour, 1-bit, 16-bit grey), JPEG (RGB, grey, CMYK, progressive 4:4:4,
  an EXIF rotation), WebP (lossy, lossy with alpha, lossless with alpha), GIF (a transparent index, two frames); at
  sizes from 1x1 through exact multiples of 40 to ones padded right and bottom;
* ``expected.npz``: ``<file>/pixel_values`` and ``<file>/image_grid_thw`` from the processor with its defaults,
  given the image as ``PIL.Image.open(path)``; ``<variant>/<file>/...`` the same under other settings;
* ``preprocessor_config.json``: what the default processor's ``save_pretrained`` writes, and
  ``variants/<variant>/preprocessor_config.json`` for each variant;
* ``meta.json``: versions, and each file's Pillow format, mode and size.

Deterministic (fixed seeds, Pillow's encoders). Run it through ``bash tests/parity/regenerate.sh --images``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import PIL
import torch
import transformers
from PIL import Image

PINNED_TRANSFORMERS = "5.23.0"
PINNED_TORCH = "2.13.0"
DEFAULT_OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "images"

# Other settings, each applied to VARIANT_FILES: other means and stds, each step alone, non-square tiles
VARIANTS = {
    "clip": {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.2613026, 0.2757771]},
    "no_rescale": {"do_rescale": False, "image_mean": [120.0, 127.5, 131.3], "image_std": [60.1, 70.0, 58.9]},
    "no_normalize": {"do_normalize": False, "rescale_factor": 0.0037},
    "tiles_32x48": {"size": {"height": 32, "width": 48}},
}
VARIANT_FILES = ("png_rgba_41x79.png", "jpeg_grey_79x41.jpg", "png_p_trns_47x53.png")


def load_processor_class() -> type:
    """transformers' Inkling2ImageProcessor. A torchvision built for CUDA beside a CPU torch cannot load its C++
    ops, and its import then fails registering fakes for two of them; the processor uses none, so those two are
    declared (nothing else) when the ops are missing."""
    spec = importlib.util.find_spec("torchvision")
    library = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    try:
        torch.ops.load_library(str(library))
    except (OSError, TypeError):
        declared = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            declared.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    from transformers.models.inkling2.image_processing_inkling2 import Inkling2ImageProcessor

    return Inkling2ImageProcessor


def smooth(rng: np.random.Generator, height: int, width: int, channels: int) -> np.ndarray:
    """uint8 [H, W, C]: a coarse random field enlarged smoothly, plus a little noise and one hard edge; such images
    exercise every value range yet compress well, keeping the fixtures small."""
    coarse = rng.integers(0, 256, (max(2, height // 12), max(2, width // 12), channels), dtype=np.uint8)
    layers = [
        np.asarray(Image.fromarray(coarse[..., c]).resize((width, height), Image.Resampling.BILINEAR))
        for c in range(channels)
    ]
    field = np.stack(layers, axis=-1).astype(np.int16) + rng.integers(-6, 7, (height, width, channels))
    field[: height // 2, : width // 3] = 255 - field[: height // 2, : width // 3]
    return np.clip(field, 0, 255).astype(np.uint8)


def alpha(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """uint8 [H, W] alpha spanning fully transparent, fully opaque and everything between."""
    ramp = np.linspace(-64, 320, width)[None, :] + np.linspace(0, 40, height)[:, None]
    values = np.clip(ramp + rng.integers(-20, 21, (height, width)), 0, 255).astype(np.uint8)
    values[rng.random((height, width)) < 0.05] = 0
    return values


def encoded(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def palette_image(rng: np.random.Generator, height: int, width: int, colours: int) -> Image.Image:
    """A P-mode image of `colours` random palette entries laid out smoothly."""
    indices = (smooth(rng, height, width, 1)[..., 0].astype(np.int32) * colours // 256).astype(np.uint8)
    image = Image.fromarray(indices, "P")
    image.putpalette(rng.integers(0, 256, colours * 3, dtype=np.uint8).tobytes())
    return image


def exif_rotated_jpeg(rng: np.random.Generator) -> bytes:
    image = Image.fromarray(smooth(rng, 41, 79, 3), "RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    return encoded(image, "JPEG", quality=90, exif=exif)


def two_frame_gif(rng: np.random.Generator) -> bytes:
    first, second = palette_image(rng, 43, 61, 32), palette_image(rng, 43, 61, 32)
    return encoded(first, "GIF", save_all=True, append_images=[second], duration=100, loop=0)


def cases() -> dict[str, Callable[[np.random.Generator], bytes]]:
    """File name -> maker of its bytes; sizes are width x height."""

    def rgb(w: int, h: int) -> Callable[[np.random.Generator], Image.Image]:
        return lambda rng: Image.fromarray(smooth(rng, h, w, 3), "RGB")

    def rgba(w: int, h: int) -> Callable[[np.random.Generator], Image.Image]:
        return lambda rng: Image.fromarray(np.dstack([smooth(rng, h, w, 3), alpha(rng, h, w)]), "RGBA")

    def grey(w: int, h: int) -> Callable[[np.random.Generator], Image.Image]:
        return lambda rng: Image.fromarray(smooth(rng, h, w, 1)[..., 0], "L")

    def grey_alpha(w: int, h: int) -> Callable[[np.random.Generator], Image.Image]:
        return lambda rng: Image.fromarray(np.dstack([smooth(rng, h, w, 1), alpha(rng, h, w)]), "LA")

    def save(make: Callable, fmt: str, **options) -> Callable[[np.random.Generator], bytes]:
        return lambda rng: encoded(make(rng), fmt, **options)

    def palette_transparent_entry(rng: np.random.Generator) -> bytes:
        return encoded(palette_image(rng, 53, 47, 16), "PNG", transparency=3)

    def palette_alpha_per_entry(rng: np.random.Generator) -> bytes:
        alphas = rng.integers(0, 256, 24, dtype=np.uint8).tobytes()
        return encoded(palette_image(rng, 40, 80, 24), "PNG", transparency=alphas)

    def gif_transparent_index(rng: np.random.Generator) -> bytes:
        return encoded(palette_image(rng, 17, 90, 8), "GIF", transparency=5)

    def one_bit(rng: np.random.Generator) -> bytes:
        return encoded(Image.fromarray(smooth(rng, 37, 43, 1)[..., 0] > 127), "PNG")

    def sixteen_bit_grey(rng: np.random.Generator) -> bytes:
        values = smooth(rng, 81, 40, 1)[..., 0].astype(np.uint16) * 257 // rng.integers(1, 300)
        return encoded(Image.fromarray(values.astype(np.uint16)), "PNG")

    def cmyk(rng: np.random.Generator) -> bytes:
        return encoded(Image.fromarray(smooth(rng, 45, 40, 4), "CMYK"), "JPEG", quality=90)

    return {
        "png_rgb_1x1.png": save(rgb(1, 1), "PNG"),
        "png_rgb_40x40.png": save(rgb(40, 40), "PNG"),
        "png_rgb_41x79.png": save(rgb(41, 79), "PNG"),
        "png_rgb_333x17.png": save(rgb(333, 17), "PNG"),
        "png_rgba_1x1.png": save(lambda rng: Image.new("RGBA", (1, 1), (250, 10, 90, 77)), "PNG"),
        "png_rgba_41x79.png": save(rgba(41, 79), "PNG"),
        "png_rgba_120x81.png": save(rgba(120, 81), "PNG"),
        "png_grey_17x333.png": save(grey(17, 333), "PNG"),
        "png_grey_alpha_41x41.png": save(grey_alpha(41, 41), "PNG"),
        "png_p_80x40.png": save(lambda rng: palette_image(rng, 40, 80, 64), "PNG"),
        "png_p_trns_47x53.png": palette_transparent_entry,
        "png_p_alpha_80x40.png": palette_alpha_per_entry,
        "png_rgb_trns_60x33.png": save(rgb(60, 33), "PNG", transparency=(12, 34, 56)),
        "png_grey_trns_33x60.png": save(grey(33, 60), "PNG", transparency=128),
        "png_1bit_43x37.png": one_bit,
        "png_grey16_40x81.png": sixteen_bit_grey,
        "jpeg_rgb_80x120.jpg": save(rgb(80, 120), "JPEG", quality=85),
        "jpeg_rgb_120x81.jpg": save(rgb(120, 81), "JPEG", quality=95, progressive=True, subsampling=0),
        "jpeg_grey_79x41.jpg": save(grey(79, 41), "JPEG", quality=80),
        "jpeg_cmyk_40x45.jpg": cmyk,
        "jpeg_exif_rotated_79x41.jpg": exif_rotated_jpeg,
        "webp_lossy_79x41.webp": save(rgb(79, 41), "WEBP", quality=80),
        "webp_lossy_alpha_81x40.webp": save(rgba(81, 40), "WEBP", quality=70),
        "webp_lossless_alpha_81x120.webp": save(rgba(81, 120), "WEBP", lossless=True),
        "gif_trns_90x17.gif": gif_transparent_index,
        "gif_two_frames_61x43.gif": two_frame_gif,
    }


def reference(processor, path: Path) -> dict[str, np.ndarray]:
    with Image.open(path) as image:
        out = processor(images=image, return_tensors="np")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture directory (rewritten)")
    args = parser.parse_args()
    if transformers.__version__ != PINNED_TRANSFORMERS or torch.__version__.split("+")[0] != PINNED_TORCH:
        sys.exit(f"need transformers {PINNED_TRANSFORMERS} and torch {PINNED_TORCH}")
    processor_class = load_processor_class()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)

    files = {}
    for index, (name, make) in enumerate(cases().items()):
        (args.out / name).write_bytes(make(np.random.default_rng(1000 + index)))
        with Image.open(args.out / name) as image:
            files[name] = {
                "format": image.format,
                "mode": image.mode,
                "transparency": image.has_transparency_data,
                "width": image.width,
                "height": image.height,
            }

    processor = processor_class()
    processor.save_pretrained(args.out)
    expected = {}
    for name in files:
        for key, value in reference(processor, args.out / name).items():
            expected[f"{name}/{key}"] = value
    for variant, settings in VARIANTS.items():
        directory = args.out / "variants" / variant
        processor_class(**settings).save_pretrained(directory)
        varied = processor_class.from_pretrained(directory)
        for name in VARIANT_FILES:
            for key, value in reference(varied, args.out / name).items():
                expected[f"{variant}/{name}/{key}"] = value
    np.savez_compressed(args.out / "expected.npz", **expected)

    versions = {"transformers": transformers.__version__, "torch": torch.__version__, "pillow": PIL.__version__}
    versions["torchvision"] = importlib.metadata.version("torchvision")
    meta = {"versions": versions, "files": files, "variants": VARIANTS, "variant_files": list(VARIANT_FILES)}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(path.stat().st_size for path in args.out.rglob("*") if path.is_file())
    print(f"{len(files)} images, {len(VARIANTS)} variants, {total / 1024:.0f} KiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
