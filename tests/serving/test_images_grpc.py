"""Images over gRPC, on the embedded checkpoint's config (configs/tiny.json: a random model with a small image tower)
in four text layers (every kind of layer and block, a third of twelve layers' compile) and float32, one engine for
the module: inkling.v1 Generate with a text prompt and with token ids, SMG's vLLM protocol
with media_refs (data: and a loopback http: URL), `serving.client --image`; each bad image refused with its status
and message, beside a stream it does not disturb."""

from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import openai
import pytest
from fake_scheduler import FakeEngine, FakeScheduler, weightless_checkpoint
from paths import REPO
from PIL import Image
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from inkling_jax.chat import ChatTemplate, load_template
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import load_config
from inkling_jax.image_processor import ImageProcessorSettings
from inkling_jax.runtime.engine import load_engine
from inkling_jax.runtime.images import IMAGE_MARKER, encode_marked
from inkling_jax.runtime.requests import ImageSource, request_from_json
from inkling_jax.runtime.scheduler import Scheduler
from serving import client, media
from serving.calls import CallError
from serving.media import MAX_IMAGE_BYTES
from serving.proto import inkling_pb2 as pb
from serving.proto import inkling_pb2_grpc as pb_grpc
from serving.server import serve

StatusCode = grpc.StatusCode
CONFIG = REPO / "configs" / "tiny.json"
IMAGE_TOKEN = 480  # configs/tiny.json's image_token_id
MAX_IMAGES, MAX_TILES = 3, 16  # 40-pixel tiles: at most 160 x 160 pixels
SIZES = ((50, 70), (30, 100))  # (height, width): 2 x 2 and 1 x 3 tiles


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def png(size: tuple[int, int], seed: int) -> bytes:
    """A random RGB PNG of (height, width), fresh pixels for each seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header says width x height and whose pixel data is empty."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")


class Served:
    def __init__(self, checkpoint: Path, engine, scheduler: Scheduler):
        self.checkpoint, self.engine, self.scheduler = checkpoint, engine, scheduler
        self.server = serve(scheduler, engine, served_model_name="tiny-mm", max_images=MAX_IMAGES)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.InklingStub(self.channel)
        self.vllm = vpb_grpc.VllmEngineStub(self.channel)
        self.tokenizer = engine.tokenizer
        self.marker = self.tokenizer.special_tokens[IMAGE_MARKER]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tiny")
    config = json.loads(CONFIG.read_text())
    config["text_config"] |= {
        "num_hidden_layers": 4,
        "n_layers_per_attn_res_block": 2,
        "layer_types": ["hybrid_sliding", "hybrid"] * 2,
    }
    config["dspark_config"]["target_layer_ids"] = [1, 3]
    (folder / "config.json").write_text(json.dumps(config))
    checkpoint = write_checkpoint(folder / "config.json", folder / "checkpoint", experts="fp32")
    engine = load_engine(
        checkpoint, dtype="float32", max_num_seqs=3, chunk=16, max_context=256, max_images=MAX_IMAGES,
        max_image_tiles=MAX_TILES,
    )  # fmt: skip
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    running = Served(checkpoint, engine, scheduler)
    yield running
    running.channel.close()
    running.server.stop(grace=0)
    scheduler.stop()


def generate(served: Served, *images: pb.Image, text: str | None = None, ids: list[int] | None = None, **stop):
    request = pb.GenerateRequest(images=images, sampling=pb.SamplingParams(temperature=0.0))
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(ids)
    request.stop.max_tokens = stop.pop("max_tokens", 8)
    request.stop.ignore_eos = stop.pop("ignore_eos", True)
    return request


def tokens_of(stub: pb_grpc.InklingStub, request: pb.GenerateRequest) -> tuple[list[int], int]:
    """(the streamed token ids, the prompt tokens the last message counts)."""
    responses = list(stub.Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].usage.prompt_tokens


def status_of(call) -> tuple[StatusCode, str]:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


@pytest.fixture(scope="module")
def pictures(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    """Two PNGs of different sizes (4 and 3 tiles), as files and bytes."""
    directory = tmp_path_factory.mktemp("pictures")
    encoded = [png(size, seed) for seed, size in enumerate(SIZES)]
    for i, data in enumerate(encoded):
        (directory / f"{i}.png").write_bytes(data)
    return directory, encoded


def batch_runner_tokens(served: Served, directory: Path, line: dict) -> tuple[list[int], int]:
    """What generate / offline's JSONL makes of the line, run through the same scheduler."""
    settings = ImageProcessorSettings.from_checkpoint(served.checkpoint)
    source = ImageSource(directory, settings, served.engine.image_limits)
    request = request_from_json(json.dumps(line), served.tokenizer, served.engine.text, None, source)
    done, tokens = threading.Event(), []

    def on_delta(delta) -> None:
        tokens.extend(delta.token_ids)
        if delta.finish_reason is not None:
            done.set()

    served.scheduler.submit(request, on_delta)
    assert done.wait(120)
    return tokens, len(request.prompt_token_ids)


@pytest.mark.slow
def test_a_text_prompt_with_two_images_equals_the_batch_runner(served, pictures):
    directory, encoded = pictures
    text = f"compare {IMAGE_MARKER} with {IMAGE_MARKER}, please"
    images = [pb.Image(data=encoded[0], media_type="image/png"), pb.Image(data=encoded[1])]
    tokens, prompt = tokens_of(served.stub, generate(served, *images, text=text))
    line = {"id": "jsonl", "prompt": text, "images": ["0.png", "1.png"], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    assert (tokens, prompt) == batch_runner_tokens(served, directory, line)
    assert prompt == len(encode_marked(served.tokenizer, text)) + 4 + 3
    stats = served.scheduler.stats()
    assert stats.image_rows_used == 0 and stats.image_rows_total == served.engine.image_limits.pool_rows


@pytest.mark.slow
def test_token_ids_place_each_image_after_its_marker(served, pictures):
    _, encoded = pictures
    text = f"{IMAGE_MARKER}{IMAGE_MARKER} two"
    images = [pb.Image(data=data) for data in encoded]
    ids = encode_marked(served.tokenizer, text)
    assert tokens_of(served.stub, generate(served, *images, ids=ids)) == tokens_of(
        served.stub, generate(served, *images, text=text)
    )
    swapped, _ = tokens_of(served.stub, generate(served, *images[::-1], ids=ids))
    assert swapped != tokens_of(served.stub, generate(served, *images, ids=ids))[0]


def bad_requests(served: Served, encoded: list[bytes]) -> list[tuple[pb.GenerateRequest, StatusCode, str]]:
    good = encoded[0]
    one = f"look {IMAGE_MARKER}"
    bmp = io.BytesIO()
    Image.new("RGB", (8, 8)).save(bmp, format="BMP")
    ids = encode_marked(served.tokenizer, one)
    image = pb.Image
    return [
        (generate(served, image(data=good[:80]), text=one), StatusCode.INVALID_ARGUMENT, "images[0]: corrupt PNG"),
        (generate(served, image(data=b"not an image at all"), text=one), StatusCode.INVALID_ARGUMENT,
         "images[0]: unsupported image format"),
        (generate(served, image(data=bmp.getvalue()), text=one), StatusCode.INVALID_ARGUMENT, "a BMP image"),
        (generate(served, image(data=good, media_type="image/jpeg"), text=one), StatusCode.INVALID_ARGUMENT,
         "media type 'image/jpeg' does not match the bytes, a PNG image"),
        (generate(served, image(data=good, media_type="image/bmp"), text=one), StatusCode.INVALID_ARGUMENT,
         "media type 'image/bmp' is not supported"),
        (generate(served, image(data=b""), text=one), StatusCode.INVALID_ARGUMENT, "images[0]: image is empty"),
        (generate(served, image(data=png_header(0, 5)), text=one), StatusCode.INVALID_ARGUMENT, "0x5: zero size"),
        (generate(served, image(data=png_header(9000, 9000)), text=one), StatusCode.INVALID_ARGUMENT,
         "image is 9000x9000 = 81000000 pixels, above the limit"),
        (generate(served, image(data=png((170, 170), 5)), text=one), StatusCode.INVALID_ARGUMENT,
         f"images[0] is 170x170: 25 tiles, more than the {MAX_TILES} an image may have"),
        (generate(served, *[image(data=good)] * 4, text=one * 4), StatusCode.INVALID_ARGUMENT,
         f"4 images, more than the {MAX_IMAGES} a request may carry"),
        (generate(served, image(data=good), image(data=good), text=one), StatusCode.INVALID_ARGUMENT,
         "the prompt marks 1 images (<|content_image|>), the request has 2"),
        (generate(served, image(data=good), ids=[*ids, IMAGE_TOKEN]), StatusCode.INVALID_ARGUMENT,
         "image placeholder tokens (480) of its own"),
        (generate(served, image(data=good + b"\0" * MAX_IMAGE_BYTES), text=one), StatusCode.INVALID_ARGUMENT,
         f"more than the {MAX_IMAGE_BYTES} an image may have"),
        (generate(served, image(data=good), ids=[1] * 4088 + ids[-1:]), StatusCode.OUT_OF_RANGE,
         "prompt (4093 tokens) + max_tokens (8) exceeds the model's 4096 positions"),
    ]  # fmt: skip


@pytest.mark.slow
def test_bad_images_are_refused_and_a_stream_beside_them_runs_on(served, pictures):
    _, encoded = pictures
    bad = bad_requests(served, encoded)
    good = generate(served, pb.Image(data=encoded[1]), text=f"{IMAGE_MARKER} long", max_tokens=48)
    alone = tokens_of(served.stub, good)
    stream = served.stub.Generate(good, timeout=120)
    first = next(stream)
    for request, code, message in bad:
        status, details = status_of(lambda request=request: list(served.stub.Generate(request, timeout=60)))
        assert (status, message in details) == (code, True), details
    rest = list(stream)
    assert [t for r in [first, *rest] for t in r.token_ids] == alone[0]
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_a_server_without_an_image_tower_refuses_images(tmp_path, pictures):
    checkpoint = weightless_checkpoint(tmp_path)
    engine = FakeEngine(load_config(checkpoint).text, None, checkpoint)
    scheduler = FakeScheduler(engine)
    server = serve(scheduler, engine)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), images=[pb.Image(data=pictures[1][0])])
            status = status_of(lambda: list(pb_grpc.InklingStub(channel).Generate(request, timeout=30)))
            assert status == (StatusCode.INVALID_ARGUMENT, "this model takes no images (the request has 1)")
    finally:
        server.stop(grace=0)
        scheduler.stop()


class PictureServer(http.server.ThreadingHTTPServer):
    """Loopback HTTP: /a.png is the picture, anything else 404, /broken 500, /moved redirects to the picture at
    the same port under the name localhost."""

    def __init__(self, picture: bytes):
        self.picture = picture

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, body = {"/a.png": (200, picture), "/broken": (500, b""), "/moved": (302, b"")}.get(
                    self.path, (404, b"")
                )
                self.send_response(code)
                if code == 302:
                    self.send_header("Location", f"http://localhost:{self.server.server_port}/a.png")
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_port}{path}"


def test_fetching_keeps_to_the_allowed_hosts_through_redirects(pictures):
    """--allowed-media-domains: a URL naming another host is refused before any connection, and so is a redirect
    to one; without a list any host is fetched."""
    _, encoded = pictures
    server = PictureServer(encoded[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert media.fetch("r", server.url("/a.png"), frozenset({"127.0.0.1"})).data == encoded[1]
        assert media.fetch("r", server.url("/moved")).data == encoded[1]
        for url, allowed in ((server.url("/a.png"), {"images.example"}), (server.url("/moved"), {"127.0.0.1"})):
            with pytest.raises(CallError) as refused:
                media.fetch("r", url, frozenset(allowed))
            assert refused.value.status == StatusCode.INVALID_ARGUMENT
            assert "which is not in --allowed-media-domains" in str(refused.value)
    finally:
        server.shutdown()
        server.server_close()


def refs_request(ids: list[int], *urls: str) -> vpb.GenerateRequest:
    request = vpb.GenerateRequest(
        stream=False,
        sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
        media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.IMAGE, url=url) for url in urls]),
    )
    request.tokenized.input_ids.extend(ids)
    return request


@pytest.mark.slow
def test_media_refs_by_data_and_http_urls(served, pictures):
    _, encoded = pictures
    info = served.vllm.GetServerInfo(vpb.GetServerInfoRequest(), timeout=10)
    assert (info.mm_processor, info.mm_media_ref_schemes, info.mm_item_limits) == (
        "inprocess",
        "data,http,https",
        f"image={MAX_IMAGES}",
    )
    model = served.vllm.GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
    assert model.supports_vision and model.max_context_length == 256  # the engine's, not the model's
    assert served.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).max_context == 256
    ids = served.tokenizer.encode(
        f"<|message_user|>{IMAGE_MARKER}<|end_message|><|message_user|>{IMAGE_MARKER}<|end_message|>"
        "<|message_user|><|content_text|>which?<|end_message|><|message_model|>",
        special_tokens=True,
    )
    expected, prompt = tokens_of(served.stub, generate(served, *[pb.Image(data=d) for d in encoded], ids=ids))
    pictures_server = PictureServer(encoded[1])
    threading.Thread(target=pictures_server.serve_forever, daemon=True).start()
    try:
        data_url = "data:image/png;base64," + base64.b64encode(encoded[0]).decode()
        (response,) = served.vllm.Generate(refs_request(ids, data_url, pictures_server.url("/a.png")), timeout=120)
        assert list(response.complete.output_ids) == expected and response.complete.prompt_tokens == prompt
        refusals = [
            ((data_url, pictures_server.url("/missing.png")), StatusCode.INVALID_ARGUMENT, "gave HTTP 404"),
            ((data_url, pictures_server.url("/broken")), StatusCode.UNAVAILABLE, "gave HTTP 500"),
            ((data_url, "http://127.0.0.1:1/a.png"), StatusCode.UNAVAILABLE, "media_refs[1]: cannot fetch"),
            ((data_url, "data:image/png;base64,!!!"), StatusCode.INVALID_ARGUMENT, "base64 payload is not valid"),
            ((data_url, "ftp://127.0.0.1/a.png"), StatusCode.INVALID_ARGUMENT, "give a data:, http: or https: URL"),
            ((data_url,), StatusCode.INVALID_ARGUMENT, "the prompt marks 2 images"),
            ((data_url,) * 4, StatusCode.INVALID_ARGUMENT, f"more than the {MAX_IMAGES}"),
        ]
        for urls, code, message in refusals:
            status, details = status_of(lambda urls=urls: list(served.vllm.Generate(refs_request(ids, *urls))))
            assert (status, message in details) == (code, True), details
    finally:
        pictures_server.shutdown()
        pictures_server.server_close()
    preprocessed = refs_request(ids)
    preprocessed.mm_inputs.im_token_id = IMAGE_TOKEN
    status, details = status_of(lambda: list(served.vllm.Generate(preprocessed)))
    assert status == StatusCode.INVALID_ARGUMENT and "mm_inputs: images processed by the gateway" in details


@pytest.mark.slow
def test_the_client_sends_images_at_markers_it_puts_in_front(served, pictures, capsys):
    directory, _ = pictures
    address = f"127.0.0.1:{served.server.port}"
    options = ["--address", address, "--max-tokens", "4", "--temperature", "0", "--ignore-eos"]
    assert client.main(["describe", "--image", str(directory / "0.png"), "--image", str(directory / "1.png"),
                        *options]) == 0  # fmt: skip
    prompt = len(encode_marked(served.tokenizer, f"{IMAGE_MARKER}{IMAGE_MARKER}describe")) + 4 + 3
    assert f"prompt {prompt} tokens, completion 4 tokens" in capsys.readouterr().err
    assert client.main(["describe", "--image", str(directory / "missing.png"), *options]) == 2
    assert "cannot read --image" in capsys.readouterr().err


@pytest.mark.slow
def test_an_openai_chat_with_an_image_through_the_smg_gateway(served, pictures):
    """The real gateway in front of the server: an image_url part as a data: URL reaches the engine as media_refs
    (the served name has no "inkling"), its placeholders after the marker the chat template renders for it."""
    _, encoded = pictures
    port = free_port()
    command = [sys.executable, "-m", "smg", "launch", "--worker-urls", f"grpc://127.0.0.1:{served.server.port}",
               "--model-path", str(served.checkpoint), "--host", "127.0.0.1", "--port", str(port), "--log-level",
               "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--worker-startup-check-interval", "1"]  # fmt: skip
    gateway = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    chat = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    url = "data:image/png;base64," + base64.b64encode(encoded[0]).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
    try:
        deadline = time.monotonic() + 90
        while True:
            assert gateway.poll() is None, gateway.stderr.read()
            try:
                reply = chat.chat.completions.create(
                    model="tiny-mm", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=4
                )
                break
            except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError) as error:
                # not up, or no worker registered yet (404 for the model, or 503 "no_models_available")
                if isinstance(error, openai.InternalServerError) and error.status_code != 503:
                    raise
                assert time.monotonic() < deadline, "the gateway did not serve within 90 s"
                time.sleep(0.5)
    finally:
        gateway.terminate()
        gateway.wait(10)
    template = ChatTemplate(load_template(served.checkpoint))
    rendered = template.render(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    )
    assert reply.usage.prompt_tokens == len(served.tokenizer.encode(rendered, special_tokens=True)) + 4
    assert reply.usage.completion_tokens >= 1
