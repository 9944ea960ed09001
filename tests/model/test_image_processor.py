"""The image processor against transformers' (tests/fixtures/images, made by tests/parity/make_image_fixtures.py):
bit-identical pixel values and equal grids for every kind of image, settings read from a checkpoint, and bad images
refused with a message naming what is wrong, the size checked on the header alone."""

import io
import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest
from paths import IMAGES, REPO
from PIL import Image, ImageFile, WebPImagePlugin

from inkling_jax.config import ConfigError
from inkling_jax.image_processor import (
    DEFAULT_MAX_PIXELS,
    PREPROCESSOR_CONFIG,
    PROCESSOR_CONFIG,
    ImageError,
    ImageProcessorSettings,
    composite_on_checkerboard,
    image_token_count,
    main,
    pixel_values,
    process_image_bytes,
    process_image_file,
    read_header,
)

META = json.loads((IMAGES / "meta.json").read_text())
EXPECTED = dict(np.load(IMAGES / "expected.npz"))
FIXTURE_SETTINGS = ImageProcessorSettings.from_checkpoint(IMAGES)


def _assert_matches(values: np.ndarray, grid: np.ndarray, prefix: str) -> None:
    expected_values, expected_grid = EXPECTED[f"{prefix}/pixel_values"], EXPECTED[f"{prefix}/image_grid_thw"]
    assert values.dtype == np.float32 and expected_values.dtype == np.float32
    assert np.array_equal(values, expected_values)
    assert grid.dtype == np.int64 and np.array_equal(grid, expected_grid)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels and whose data holds none: decoding it would fail."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    signature = b"\x89PNG\r\n\x1a\n"
    return signature + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", zlib.compress(b"")) + _png_chunk(b"IEND", b"")


def _encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoding fails the test."""

    def refuse(self):
        raise AssertionError("pixels were decoded")

    for decoder in (ImageFile.ImageFile, WebPImagePlugin.WebPImageFile):  # WebP decodes in a load of its own
        monkeypatch.setattr(decoder, "load", refuse)


@pytest.mark.parametrize("name", sorted(META["files"]))
def test_pixel_values_and_grid_equal_transformers(name):
    values, grid = process_image_file(IMAGES / name, FIXTURE_SETTINGS)
    _assert_matches(values, grid, name)
    file = META["files"][name]
    assert image_token_count(file["height"], file["width"], FIXTURE_SETTINGS) == int(np.prod(grid)) == len(values)


@pytest.mark.parametrize("name", sorted(META["files"]))
def test_header_gives_the_size_without_decoding(name, no_decoding):
    header = read_header((IMAGES / name).read_bytes(), FIXTURE_SETTINGS)
    file = META["files"][name]
    assert (header.format, header.width, header.height) == (file["format"], file["width"], file["height"])


@pytest.mark.parametrize("variant", sorted(META["variants"]))
@pytest.mark.parametrize("name", META["variant_files"])
def test_other_settings_from_their_config_equal_transformers(variant, name):
    settings = ImageProcessorSettings.from_checkpoint(IMAGES / "variants" / variant)
    values, grid = process_image_file(IMAGES / name, settings)
    _assert_matches(values, grid, f"{variant}/{name}")
    height, width = META["files"][name]["height"], META["files"][name]["width"]
    assert image_token_count(height, width, settings) == len(values)


def test_fixture_settings_are_the_defaults_and_so_are_a_directory_without_them(tmp_path):
    assert FIXTURE_SETTINGS == ImageProcessorSettings()
    assert ImageProcessorSettings.from_checkpoint(tmp_path) == ImageProcessorSettings()
    config_file = tmp_path / "config.json"  # a bare config, as a dummy checkpoint may be
    config_file.write_text("{}")
    assert ImageProcessorSettings.from_checkpoint(config_file, max_pixels=99) == ImageProcessorSettings(max_pixels=99)


def test_variant_settings_are_read_from_their_files():
    settings = ImageProcessorSettings.from_checkpoint(IMAGES / "variants" / "tiles_32x48")
    assert (settings.tile_height, settings.tile_width) == (32, 48)
    settings = ImageProcessorSettings.from_checkpoint(IMAGES / "variants" / "no_rescale")
    assert not settings.do_rescale and settings.image_std == (60.1, 70.0, 58.9)


def test_processor_config_image_processor_object_comes_first(tmp_path):
    """transformers' order: processor_config.json's `image_processor`, then preprocessor_config.json."""
    shutil.copy(IMAGES / "variants" / "clip" / PREPROCESSOR_CONFIG, tmp_path / PREPROCESSOR_CONFIG)
    assert ImageProcessorSettings.from_checkpoint(tmp_path).image_mean[0] == 0.48145466
    nested = {"image_processor": json.loads((IMAGES / "variants" / "tiles_32x48" / PREPROCESSOR_CONFIG).read_text())}
    (tmp_path / PROCESSOR_CONFIG).write_text(json.dumps(nested))
    settings = ImageProcessorSettings.from_checkpoint(tmp_path)
    assert settings.image_mean == (0.5, 0.5, 0.5) and settings.tile_width == 48
    (tmp_path / PROCESSOR_CONFIG).write_text(json.dumps({"processor_class": "Inkling2Processor"}))
    assert ImageProcessorSettings.from_checkpoint(tmp_path).image_mean[0] == 0.48145466


def test_one_number_serves_all_channels():
    settings = ImageProcessorSettings.from_dict({"image_mean": 0.25, "image_std": [2]})
    assert settings.image_mean == (0.25,) * 3 and settings.image_std == (2.0,) * 3
    assert ImageProcessorSettings.from_dict({"size": 32}).tile_width == 32
    assert ImageProcessorSettings.from_dict({"size": [32, 48]}).tile_width == 48


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"do_rescale": "yes"}, "do_rescale must be true or false, got 'yes'"),
        ({"do_normalize": None}, "do_normalize must be true or false, got None"),
        ({"do_convert_rgb": False}, "do_convert_rgb: false is not supported"),
        ({"rescale_factor": 0}, "rescale_factor must be positive and finite, got 0.0"),
        ({"rescale_factor": "1/255"}, "rescale_factor must be a number"),
        ({"image_mean": [0.5, 0.5]}, "image_mean must be a number or a list of 1 or 3 numbers"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std must be finite and nonzero, got [0.5, 0.0, 0.5]"),
        ({"image_mean": [0.5, float("nan"), 0.5]}, "image_mean must be finite"),
        ({"image_std": [0.5, None, 0.5]}, "image_std must be a number, got None"),
        ({"size": {"height": 0, "width": 40}}, "size must be {'height': h, 'width': w}, [h, w] or one integer"),
        ({"size": {"shortest_edge": 40}}, "all positive, got {'shortest_edge': 40}"),
        ({"size": [40, 40, 3]}, "all positive, got [40, 40, 3]"),
    ],
)
def test_bad_settings_name_the_field(fields, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        ImageProcessorSettings.from_dict(fields)


def test_unreadable_settings_and_missing_checkpoints_are_config_errors(tmp_path):
    (tmp_path / PREPROCESSOR_CONFIG).write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*preprocessor_config.json"):
        ImageProcessorSettings.from_checkpoint(tmp_path)
    (tmp_path / PREPROCESSOR_CONFIG).write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        ImageProcessorSettings.from_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        ImageProcessorSettings.from_checkpoint(tmp_path / "missing")
    with pytest.raises(ConfigError, match="max_pixels must be a positive"):
        ImageProcessorSettings(max_pixels=0)


def test_checkerboard_and_tiles_in_raster_order():
    rgba = np.zeros((9, 17, 4), np.uint8)
    rgba[..., :3], rgba[:, 16:, 3] = 7, 255
    rgb = composite_on_checkerboard(rgba)
    assert [rgb[0, 0, 0], rgb[0, 8, 1], rgb[8, 0, 2], rgb[8, 8, 0]] == [204, 153, 153, 204] and (rgb[:, 16] == 7).all()
    rgba[..., 3] = 128  # (7 * 128 + 204 * 127 + 127) // 255 = 105: rounded to nearest
    assert composite_on_checkerboard(rgba)[0, 0, 0] == 105
    blocks = np.arange(6, dtype=np.uint8).reshape(2, 3).repeat(40, 0).repeat(40, 1)[:79, :81]
    values, grid = pixel_values(np.dstack([blocks] * 3))
    assert grid.tolist() == [[1, 2, 3]] and values.shape == (6, 40, 40, 3)
    half = np.float32(127.5)
    assert [values[i, 0, 0, 0] for i in range(6)] == [(np.float32(i) - half) / half for i in range(6)]
    pad = (np.float32(-1) - half) / half
    assert (values[5, 39] == pad).all() and (values[2, :, 1:] == pad).all() and (values[2, :, 0] != pad).all()


def test_token_count_without_decoding():
    assert image_token_count(1, 1) == 1 and image_token_count(40, 40) == 1 and image_token_count(41, 40) == 2
    assert image_token_count(17, 333) == 9 and image_token_count(81, 120) == 9 and image_token_count(4000, 3000) == 7500


def test_media_type_must_name_an_accepted_format_and_the_bytes_decide():
    data = (IMAGES / "png_rgba_41x79.png").read_bytes()
    values, grid = process_image_bytes(data, media_type="image/jpeg")  # mislabelled: decoded as the PNG it is
    _assert_matches(values, grid, "png_rgba_41x79.png")
    assert read_header(data, media_type="Image/PNG; q=1").format == "PNG"
    with pytest.raises(ImageError, match="media type 'image/tiff' is not supported; images are PNG, JPEG, WebP"):
        process_image_bytes(data, media_type="image/tiff")


def test_over_the_limit_refused_from_the_header(no_decoding):
    huge = _png_claiming(30000, 30000)
    message = f"image is 30000x30000 = 900000000 pixels, above the limit of {DEFAULT_MAX_PIXELS}"
    with pytest.raises(ImageError, match=message):
        process_image_bytes(huge)
    with pytest.raises(ImageError, match=message):
        read_header(huge)
    data = (IMAGES / "png_rgb_41x79.png").read_bytes()
    assert read_header(data, ImageProcessorSettings(max_pixels=41 * 79)).width == 41
    with pytest.raises(ImageError, match="41x79 = 3239 pixels, above the limit of 3238"):
        process_image_bytes(data, ImageProcessorSettings(max_pixels=41 * 79 - 1))


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "image is empty (0 bytes)"),
        (_png_claiming(0, 17), "image is 0x17: zero size"),
        (b"plain text, not an image at all", "unsupported image format (not an image format we know)"),
        (_encoded(Image.new("RGB", (4, 4)), "TIFF"), "unsupported image format (a TIFF image)"),
        (_encoded(Image.new("RGB", (4, 4)), "BMP"), "unsupported image format (a BMP image)"),
        (_png_claiming(30, 20), "corrupt PNG image data"),
        ((IMAGES / "jpeg_rgb_120x81.jpg").read_bytes()[:3000], "corrupt JPEG image data"),
        ((IMAGES / "webp_lossy_alpha_81x40.webp").read_bytes()[:-100], "not a valid WebP image"),
        (b"\xff\xd8\xff\xe0" + bytes(60), "not a valid JPEG image"),
    ],
)
def test_bad_images_are_named(data, fragment):
    with pytest.raises(ImageError, match=re.escape(fragment)):
        process_image_bytes(data)


def _cli(*argv: str) -> tuple[int, list[str]]:
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = main(list(argv))
    return code, stderr.getvalue().splitlines()


def test_cli_writes_the_arrays(tmp_path):
    name = "webp_lossless_alpha_81x120.webp"
    code, lines = _cli("--checkpoint", str(IMAGES), "--image", str(IMAGES / name), "--output", str(tmp_path / "o.npz"))
    assert (code, lines) == (0, [])
    with np.load(tmp_path / "o.npz") as written:
        assert sorted(written) == ["image_grid_thw", "pixel_values"]
        _assert_matches(written["pixel_values"], written["image_grid_thw"], name)


def test_cli_as_a_module(tmp_path):
    name = "jpeg_cmyk_40x45.jpg"
    command = [sys.executable, "-m", "inkling_jax.image_processor", "--checkpoint", str(tmp_path)]
    command += ["--image", str(IMAGES / name), "--output", str(tmp_path / "o.npz")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "o.npz") as written:
        _assert_matches(written["pixel_values"], written["image_grid_thw"], name)


@pytest.mark.parametrize(
    ("content", "extra", "fragment"),
    [
        (None, [], "cannot read image file"),
        (b"\x89PNG\r\n\x1a\n" + bytes(40), [], "not a valid PNG image"),
        (_encoded(Image.new("RGB", (4, 4)), "TIFF"), [], "unsupported image format (a TIFF image)"),
        (_png_claiming(0, 5), [], "image is 0x5: zero size"),
        (_png_claiming(30000, 30000), [], "image is 30000x30000 = 900000000 pixels, above the limit"),
        (_encoded(Image.new("RGB", (50, 50)), "PNG"), ["--max-pixels", "2000"], "above the limit of 2000"),
    ],
)
def test_cli_refuses_bad_images_in_one_line(content, extra, fragment, tmp_path):
    image = tmp_path / "image.bin"
    if content is not None:
        image.write_bytes(content)
    code, lines = _cli("--checkpoint", str(IMAGES), "--image", str(image), "--output", str(tmp_path / "o.npz"), *extra)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not (tmp_path / "o.npz").exists()


def test_cli_refuses_bad_settings_and_unwritable_output(tmp_path):
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps({"image_std": [1, 0, 1]}))
    image = str(IMAGES / "png_rgb_1x1.png")
    code, lines = _cli("--checkpoint", str(tmp_path), "--image", image, "--output", str(tmp_path / "o.npz"))
    assert code == 2 and len(lines) == 1 and f"{tmp_path / PREPROCESSOR_CONFIG}: image_std must be finite" in lines[0]
    code, lines = _cli("--checkpoint", str(IMAGES), "--image", image, "--output", "o.npz", "--max-pixels", "0")
    assert code == 2 and lines == ["error: max_pixels must be a positive number of pixels, got 0"]
    output = str(Path(tmp_path / "no" / "dir" / "o.npz"))
    code, lines = _cli("--checkpoint", str(IMAGES), "--image", image, "--output", output)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: cannot write")
