"""Images at a checkpoint's vision widths: the image processor on the host, the tower on the device, and the
prefill of a prompt holding an image.

    python -m bench.vision --checkpoint DIR [--load-format dummy] [--size 1024] [--repeats 10] [--chunk 512]
        [--kv-cache-mib MIB] [--max-image-tiles 1024] [--out FILE.json]

- processor: images/s of `image_processor.process_image_bytes` on a size x size photo-like image (a smooth
  gradient with noise) encoded as PNG and as JPEG, decoding included (one host thread);
- tower: device time of the engine's encode program for that image (its tiles padded to their bucket, as the
  engine encodes it; CUPTI on a GPU), as images/s, beside the tower's attention alone (all its layers, in the
  tower's own path) and, on a GPU, cuDNN's fused attention over the same sequence (`jax.nn.dot_product_attention`):
  the floor of what the tower's attention costs;
- prefill: time to first token of one request (max_tokens 1) whose prompt holds the image's placeholders between
  two short runs of text, encode included, against a text prompt of the same length, each as prompt tokens/s
  (median of `repeats`, one request at a time, the engine warmed up first).
For the real model's widths: `inkling-synthetic --config configs/proxy_h200.json --out DIR --no-weights`, then
`--checkpoint DIR --load-format dummy`.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from bench.timing import call_kernels_ms, device_ms
from inkling_jax.image_processor import ImageProcessorSettings, process_image_bytes
from inkling_jax.model.vision import fused_image_attention, image_attention, image_layout
from inkling_jax.runtime.engine import add_load_format_argument, load_engine
from inkling_jax.runtime.images import RequestImage, check_images
from inkling_jax.runtime.requests import Request
from inkling_jax.runtime.scheduler import Scheduler

TEXT_AROUND = 32  # text tokens before and after the image's placeholders


def photo_like(size: int, seed: int = 0) -> np.ndarray:
    """[size, size, 3] uint8: colour gradients with mild noise (compresses as a photo does, unlike pure noise)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size, dtype=np.float32)
    channels = [np.outer(ramp, ramp), np.outer(ramp[::-1], ramp), np.outer(ramp, ramp[::-1])]
    image = np.stack(channels, axis=-1) * 200 + rng.normal(0, 12, (size, size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def processor_rates(pixels: np.ndarray, settings: ImageProcessorSettings, repeats: int) -> dict[str, dict]:
    """Per format: encoded bytes and images/s of processing them (median of `repeats`)."""
    rates = {}
    for name, media_type in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
        data = encoded(pixels, name)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            process_image_bytes(data, settings, media_type)
            times.append(time.perf_counter() - start)
        rates[name] = {"bytes": len(data), "ms": 1e3 * statistics.median(times)}
        rates[name]["images_per_s"] = 1e3 / rates[name]["ms"]
    return rates


def attention_ms(engine, bucket: int, repeats: int) -> dict[str, float]:
    """The tower's attention over one bucket's sequence (an image of every tile and a padding one), all layers:
    in the tower's own path and, on a GPU, as cuDNN's fused attention alone."""
    config = engine.vision
    merge, heads = config.spatial_merge_size, config.num_attention_heads
    head_dim, layers = config.hidden_size // heads, config.num_hidden_layers
    patches = bucket * merge * merge
    grid = jnp.asarray([[1, 1, bucket - 1], [1, 1, 1]], jnp.int32)
    segments = image_layout(grid, patches, merge, config.posemb_grid_size).segments
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(segments.shape[0], heads, head_dim)), engine.dtype) for _ in range(3))
    paths = {"tower_path": image_attention}
    if jax.default_backend() == "gpu":
        paths["cudnn_floor"] = fused_image_attention
    scale = head_dim**-0.5
    return {
        name: layers
        * device_ms(jax.jit(lambda q, k, v, s, fn=fn: fn(q, k, v, s, scale)), q, k, v, segments, repeats=repeats)[0]
        for name, fn in paths.items()
    }


def time_to_first_token_s(scheduler: Scheduler, request: Request) -> float:
    """Seconds from submitting `request` (max_tokens 1) to its token."""
    done = threading.Event()
    start = time.perf_counter()
    scheduler.submit(request, lambda delta: done.set() if delta.finish_reason is not None else None)
    done.wait()
    return time.perf_counter() - start


def prefill_rates(engine, image: RequestImage, repeats: int) -> dict[str, dict]:
    """Prompt tokens/s to the first token of a prompt with the image and of a text prompt as long."""
    rng, placeholder = np.random.default_rng(1), engine.image_limits.image_token_id

    def text(count: int) -> list[int]:  # ordinary tokens (the low ids), no placeholder among them
        ids = rng.integers(0, min(engine.text.unpadded_vocab_size, 100_000), count)
        return np.where(ids == placeholder, placeholder - 1, ids).tolist()

    with_image = text(TEXT_AROUND) + [placeholder] * image.tiles + text(TEXT_AROUND)
    text_only = text(len(with_image))
    scheduler = Scheduler(engine, max_waiting=1)
    scheduler.warm_up()
    scheduler.start()
    try:
        cases = {"image": (with_image, (image,)), "text": (text_only, ())}
        rates = {}
        for name, (ids, images) in cases.items():
            times = [
                time_to_first_token_s(scheduler, Request(f"{name}{i}", ids, max_tokens=1, images=images))
                for i in range(repeats + 1)
            ][1:]  # the first run also fills caches on the host
            ms = 1e3 * statistics.median(times)
            rates[name] = {"prompt_tokens": len(ids), "ms": ms, "tokens_per_s": len(ids) / ms * 1e3}
    finally:
        scheduler.stop()
    return rates


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a checkpoint with a vision tower")
    add_load_format_argument(parser)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--size", type=int, default=1024, help="the image's width and height in pixels")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--kv-cache-mib", type=float, help="default: room for the longest prompt")
    parser.add_argument("--max-image-tiles", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    engine = load_engine(
        args.checkpoint,
        load_format=args.load_format,
        dtype=args.dtype,
        max_num_seqs=1,
        chunk=args.chunk,
        kv_cache_mib=args.kv_cache_mib,
        max_context=args.max_image_tiles + 2 * TEXT_AROUND + 1,
        max_image_tiles=args.max_image_tiles,
    )
    if engine.image_limits is None:
        parser.error(f"checkpoint {args.checkpoint} has no vision tower")
    settings = ImageProcessorSettings.from_checkpoint(args.checkpoint)
    pixels = photo_like(args.size)
    values, grid = process_image_bytes(encoded(pixels, "PNG"), settings, "image/png")
    image = RequestImage(values, grid)
    check = check_images([image], [engine.image_limits.image_token_id] * image.tiles, engine.image_limits)
    if check is not None:
        parser.error(f"checkpoint {args.checkpoint}'s processor settings do not fit its tower: {check}")
    bucket = next(b for b in engine.image_buckets if b >= image.tiles)
    engine.warm_up()
    tower_ms = encode_ms(engine, image, args.repeats)
    tower = {"ms": tower_ms, "images_per_s": 1e3 / tower_ms, "attention_ms": attention_ms(engine, bucket, args.repeats)}
    report = {
        "command": "python -m bench.vision " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind,
        "image": {"size": args.size, "tiles": image.tiles, "bucket": bucket},
        "processor": processor_rates(pixels, settings, args.repeats),
        "tower": tower,
        "prefill": prefill_rates(engine, image, args.repeats),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


def encoded(pixels: np.ndarray, image_format: str) -> bytes:
    """The image's bytes in `image_format` ("PNG", "JPEG")."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=image_format)
    return buffer.getvalue()


def encoded_pool(engine, image: RequestImage, rows: np.ndarray) -> jax.Array:
    """The engine's image pool once `image` is encoded into `rows`: what a timed encode waits for (`encode` itself
    returns at once)."""
    engine.encode(image, rows)
    return engine.image_pool


def encode_ms(engine, image: RequestImage, repeats: int) -> float:
    """The engine's encode of `image`: its kernels' device time on a GPU (CUPTI), the median wall time elsewhere."""
    rows = np.arange(image.tiles, dtype=np.int32)
    if jax.default_backend() == "gpu":
        return sum(ms for _, ms in call_kernels_ms(lambda: encoded_pool(engine, image, rows), repeats=repeats))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(encoded_pool(engine, image, rows))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


if __name__ == "__main__":
    main()
