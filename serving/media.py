"""Images from the network: encoded bytes (inkling.v1's `images`; SMG's `media_refs`, fetched from data: and
http(s) URLs) checked and processed into the engine's `RequestImage`s, every failure a `CallError` naming the image.

A request's images are checked in order of cost, so a bad one costs little: their count against the server's
limit first; each image's bytes against `MAX_IMAGE_BYTES`, then its header (format, media type, size, pixels and
tiles: `tiles_of`) while the prompt is prepared, the expanded prompt against the context (the placeholder runs
that follow the markers); and only then are pixels decoded (`decode`), on the server's image threads, never on the
event loop or the threads that tokenize other requests' text.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

import grpc

from inkling_jax.config import ConfigError
from inkling_jax.image_processor import (
    MEDIA_TYPES,
    ImageError,
    ImageProcessorSettings,
    image_token_count,
    process_image_bytes,
    read_header,
)
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.images import IMAGE_MARKER, ImageLimits, RequestImage, expand_after_markers, placeholder_runs
from serving.calls import CallError

MAX_IMAGE_BYTES = 16 << 20  # one encoded image
# What each image a request may carry adds to the server's message size limit: an image of MAX_IMAGE_BYTES as
# a base64 data: URL (4/3 of its bytes) and its framing.
IMAGE_MESSAGE_BYTES = 24 << 20
FETCH_TIMEOUT_SECONDS = 10.0  # a whole http(s) fetch: connecting, the headers and every byte
URL_SCHEMES = ("data", "http", "https")
FETCH_CHUNK_BYTES = 1 << 16


@dataclasses.dataclass(frozen=True)
class EncodedImage:
    """An image as it arrived: `name` says which one in messages (e.g. "images[1]"); `media_type` None: the bytes
    say what it is."""

    name: str
    data: bytes
    media_type: str | None = None


@dataclasses.dataclass(frozen=True)
class ImageSetup:
    """What a server over an image model needs to take images: the checkpoint's processor settings, the engine's
    limits and the tokenizer's `<|content_image|>` id (None: no tokenizer, so no marker to place images at)."""

    settings: ImageProcessorSettings
    limits: ImageLimits
    marker_id: int | None


def image_setup(engine: Engine) -> ImageSetup | None:
    """The engine's image setup (None for a model without an image tower); ConfigError for processor settings
    that are unreadable or whose tiles are not the tower's."""
    limits = engine.image_limits
    if limits is None:
        return None
    settings = ImageProcessorSettings.from_checkpoint(engine.checkpoint)
    if (settings.tile_height, settings.tile_width) != limits.tile_shape[:2]:
        raise ConfigError(
            f"{engine.checkpoint}: the image processor's {settings.tile_height}x{settings.tile_width} tiles are not "
            f"the image tower's {limits.tile_shape[0]}x{limits.tile_shape[1]}"
        )
    marker = engine.tokenizer.special_tokens.get(IMAGE_MARKER) if engine.tokenizer is not None else None
    return ImageSetup(settings, limits, marker)


def _refuse(message: str) -> CallError:
    return CallError(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_count(count: int, setup: ImageSetup | None) -> ImageSetup | None:
    """The setup, when a request of `count` images is one the server may take: none for a model without an
    image tower, at most `max_images`, and a marker to place them at."""
    if not count:
        return setup
    if setup is None:
        raise _refuse(f"this model takes no images (the request has {count})")
    if count > setup.limits.max_images:
        raise _refuse(f"{count} images, more than the {setup.limits.max_images} a request may carry")
    if setup.marker_id is None:
        raise CallError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"images go at {IMAGE_MARKER} markers, and this checkpoint has no tokenizer to know that token",
        )
    return setup


def tiles_of(image: EncodedImage, setup: ImageSetup) -> int:
    """The image's tiles (image tokens), from its header alone: refused when empty or over MAX_IMAGE_BYTES, of an
    unsupported format or another than its media type says, of zero size, over the pixel or the tile limit."""
    if len(image.data) > MAX_IMAGE_BYTES:
        raise _refuse(f"{image.name} is {len(image.data)} bytes, more than the {MAX_IMAGE_BYTES} an image may have")
    try:
        header = read_header(image.data, setup.settings, image.media_type)
    except ImageError as error:
        raise _refuse(f"{image.name}: {error}") from None
    if image.media_type is not None and MEDIA_TYPES[_bare(image.media_type)] != header.format:
        raise _refuse(
            f"{image.name}: media type {image.media_type!r} does not match the bytes, a {header.format} image"
        )
    tiles = image_token_count(header.height, header.width, setup.settings)
    if tiles > setup.limits.max_tiles:
        raise _refuse(
            f"{image.name} is {header.width}x{header.height}: {tiles} tiles, more than the {setup.limits.max_tiles} "
            "an image may have"
        )
    return tiles


def expand(token_ids: Sequence[int], tiles: Sequence[int], setup: ImageSetup) -> list[int]:
    """The prompt with each `<|content_image|>` followed by its image's run of placeholders; refused when the
    markers and images do not pair up or the prompt holds placeholders of its own."""
    try:
        expanded = expand_after_markers(token_ids, setup.marker_id, tiles, setup.limits.image_token_id)
    except ValueError as error:
        raise _refuse(str(error)) from None
    runs = [length for _, length in placeholder_runs(expanded, setup.limits.image_token_id)]
    if runs != list(tiles):
        raise _refuse(
            f"the prompt holds image placeholder tokens ({setup.limits.image_token_id}) of its own: the server puts "
            f"each image's run after its {IMAGE_MARKER} marker"
        )
    return expanded


def decode(image: EncodedImage, setup: ImageSetup) -> RequestImage:
    """The image's pixel values (run on the server's image threads); refused when its pixel data is corrupt."""
    try:
        pixels, grid = process_image_bytes(image.data, setup.settings, image.media_type)
    except ImageError as error:
        raise _refuse(f"{image.name}: {error}") from None
    return RequestImage(pixels, grid)


def _bare(media_type: str) -> str:
    return media_type.split(";", 1)[0].strip().lower()


def fetch(
    name: str, url: str, allowed_hosts: frozenset[str] | None = None, timeout: float = FETCH_TIMEOUT_SECONDS
) -> EncodedImage:
    """The image a data: or http(s) URL holds, at most MAX_IMAGE_BYTES, from one of `allowed_hosts` (None: any;
    redirects too). INVALID_ARGUMENT for what the client must fix (another scheme or host, a malformed data: URL,
    an image too large, an HTTP 4xx); UNAVAILABLE for what may pass (the host unreachable, a timeout, an HTTP 5xx)."""
    if url_scheme(name, url) == "data":
        return _from_data_url(name, url)
    _check_host(name, url, allowed_hosts)
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(_CheckedRedirects(name, allowed_hosts))
    try:
        with opener.open(url, timeout=timeout) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > MAX_IMAGE_BYTES:
                raise _refuse(f"{name}: {url} holds {length} bytes, more than the {MAX_IMAGE_BYTES} an image may have")
            data = bytearray()
            while chunk := response.read(FETCH_CHUNK_BYTES):
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise _refuse(f"{name}: {url} holds more than the {MAX_IMAGE_BYTES} bytes an image may have")
                if time.monotonic() > deadline:
                    raise CallError(grpc.StatusCode.UNAVAILABLE, f"{name}: fetching {url} took over {timeout:g} s")
            media_type = response.headers.get_content_type() if response.headers.get("Content-Type") else None
    except urllib.error.HTTPError as error:
        status = grpc.StatusCode.UNAVAILABLE if error.code >= 500 or error.code == 429 else None
        raise CallError(
            status or grpc.StatusCode.INVALID_ARGUMENT, f"{name}: fetching {url} gave HTTP {error.code} {error.reason}"
        ) from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        reason = getattr(error, "reason", error)
        raise CallError(grpc.StatusCode.UNAVAILABLE, f"{name}: cannot fetch {url}: {reason}") from None
    except ValueError as error:  # a URL urllib cannot parse
        raise _refuse(f"{name}: cannot fetch {url!r}: {error}") from None
    return EncodedImage(name, bytes(data), media_type if media_type in MEDIA_TYPES else None)


def url_scheme(name: str, url: str) -> str:
    """The URL's scheme, one of URL_SCHEMES; INVALID_ARGUMENT naming `name` for any other."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in URL_SCHEMES:
        raise _refuse(f"{name}: URL scheme {scheme or '(none)'!r} is not accepted; give a data:, http: or https: URL")
    return scheme


def _check_host(name: str, url: str, allowed_hosts: frozenset[str] | None) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if allowed_hosts is not None and host not in allowed_hosts:
        raise _refuse(f"{name}: {url} names host {host or '(none)'!r}, which is not in --allowed-media-domains")


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, name: str, allowed_hosts: frozenset[str] | None):
        self.name, self.allowed_hosts = name, allowed_hosts

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(self.name, newurl, self.allowed_hosts)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _from_data_url(name: str, url: str) -> EncodedImage:
    """The bytes of `data:[<media type>][;base64],<payload>`, checked for size before they are decoded."""
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise _refuse(f"{name}: a data: URL needs a ',' before its payload")
    parameters = header.split(";")
    is_base64 = parameters[-1].strip().lower() == "base64"
    if len(payload) > (MAX_IMAGE_BYTES * 4 // 3 + 4 if is_base64 else 3 * MAX_IMAGE_BYTES):
        raise _refuse(f"{name}: the data: URL holds more than the {MAX_IMAGE_BYTES} bytes an image may have")
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else urllib.parse.unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as error:
        raise _refuse(f"{name}: the data: URL's base64 payload is not valid: {error}") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise _refuse(
            f"{name}: the data: URL holds {len(data)} bytes, more than the {MAX_IMAGE_BYTES} an image may have"
        )
    media_type = parameters[0].strip() or None
    return EncodedImage(name, data, media_type)
