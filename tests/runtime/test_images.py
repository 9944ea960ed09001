"""Images through the engine on the tiny_mm parity config in four text layers with random weights and a DSpark draft
(float32; every kind of layer and block in step programs that compile in half of seven layers' time), with the parity
fixture's prompts and pixel values: greedy generation with one and two images equals greedy decoding of whole-sequence
`multimodal_logits`, with placeholder runs cut by prefill chunks, beside other requests and after a preemption, with
nothing compiled after warm-up; the batch runner's JSONL "images"."""

import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from model_configs import FOUR_LAYERS, TINY
from paths import PARITY
from PIL import Image

from inkling_jax.cache import PAGE_SIZE, CacheLayout
from inkling_jax.chat import DEFAULT_TEMPLATE, ChatTemplate
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.checkpoint.synthetic_tokenizer import build_tokenizer, write_tokenizer
from inkling_jax.config import load_config
from inkling_jax.forward import image_features_fn, multimodal_logits
from inkling_jax.generate import main
from inkling_jax.image_processor import ImageProcessorSettings, process_image_file
from inkling_jax.runtime.batch import generate as generate_requests
from inkling_jax.runtime.engine import Engine
from inkling_jax.runtime.images import (
    IMAGE_MARKER,
    RequestImage,
    encode_programs_for,
    image_buckets,
    image_limits,
    placeholder_runs,
)
from inkling_jax.runtime.requests import (
    MAX_LOGPROBS,
    Code,
    ImageSource,
    Rejected,
    Request,
    request_from_json,
    validate,
)
from inkling_jax.runtime.scheduler import Scheduler
from inkling_jax.sharding import make_mesh
from inkling_jax.tokenizer import Tokenizer

MM = PARITY / "tiny_mm"
CHUNK = 8  # cuts the fixtures' placeholder runs (positions 5-16 and 4-15)
TILES = 16  # the most tiles an image may have: one encode bucket
IMAGE_TOKEN = 300


DRAFT = {"num_hidden_layers": 1, "block_size": 3, "target_layer_ids": [1, 3], "mask_token_id": 370, "markov_rank": 8}


@pytest.fixture(scope="module")
def fixture() -> dict[str, np.ndarray]:
    return dict(np.load(MM / "images.npz"))


@pytest.fixture(scope="module")
def mm_checkpoint(tmp_path_factory) -> Path:
    """tiny_mm's config with four text layers in blocks of two (sliding, full), random fp32 weights and a draft."""
    folder = tmp_path_factory.mktemp("tiny_mm_four")
    config = json.loads((MM / "hf" / "config.json").read_text())
    config["text_config"] |= FOUR_LAYERS
    (folder / "config.json").write_text(json.dumps(config))
    out = write_checkpoint(folder / "config.json", folder / "checkpoint", experts="fp32", seed=6, draft=DRAFT)
    shutil.copy(MM / "hf" / "preprocessor_config.json", out / "preprocessor_config.json")
    return out


@pytest.fixture(scope="module")
def reference_model(mm_checkpoint):
    return load_causal_lm(mm_checkpoint, np.float32)[1]


def case(fixture: dict, name: str) -> tuple[tuple[int, ...], tuple[RequestImage, ...]]:
    """A fixture prompt (placeholders expanded) and its images, one RequestImage per grid row."""
    pixels, grids = fixture[f"{name}_pixel_values"], fixture[f"{name}_image_grid_thw"]
    ends = np.cumsum(np.prod(grids, axis=1))[:-1]
    images = tuple(RequestImage(p, g[None]) for p, g in zip(np.split(pixels, ends), grids, strict=True))
    return tuple(fixture[f"{name}_input_ids"].tolist()), images


def greedy_reference(model, prompt: tuple[int, ...], images: tuple[RequestImage, ...], count: int) -> list[int]:
    """Greedy continuation by whole-sequence scoring (one fixed length: later positions cannot reach earlier
    logits)."""
    pixels = np.concatenate([image.pixel_values for image in images])
    grid = np.concatenate([image.image_grid_thw for image in images])
    ids = np.zeros(len(prompt) + count, np.int32)
    ids[: len(prompt)] = prompt
    for position in range(len(prompt), len(ids)):
        ids[position] = int(np.argmax(np.asarray(multimodal_logits(model, ids, pixels, grid))[position - 1]))
    return ids[len(prompt) :].tolist()


@pytest.fixture(scope="module")
def engine(mm_checkpoint) -> Engine:
    """Two slots sharing 3 pages of 128 tokens (two sequences past position 128 cannot both hold theirs), and a
    prefix cache."""
    model = load_causal_lm(mm_checkpoint, np.float32)[1]
    layout = CacheLayout(2, 3, 4, CHUNK)
    mesh = make_mesh("tp1", model.config)
    return Engine(model, layout, mesh, num_top=MAX_LOGPROBS, max_image_tiles=TILES, snapshots=2)


class Collector:
    def __init__(self, count: int):
        self.tokens: dict[str, list[int]] = {}
        self.left, self.done = count, threading.Event()

    def sink(self, request_id: str):
        self.tokens[request_id] = []

        def on_delta(delta):
            self.tokens[request_id].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self.left -= 1
                if self.left == 0:
                    self.done.set()

        return on_delta


def run(scheduler: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    collector = Collector(len(requests))
    for request in requests:
        scheduler.submit(request, collector.sink(request.id))
    assert collector.done.wait(300)
    return collector.tokens


@pytest.fixture(scope="module")
def scheduler(engine):
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    yield scheduler
    scheduler.stop()


def test_an_image_encoded_in_its_bucket_has_its_features_alone(fixture, reference_model, engine):
    """The encode program pads an image to its bucket with an image of its own, which the tower's per-image
    attention keeps apart: on the CPU the rows it writes equal the tower's features of the image alone, to the bit,
    and it writes no other row."""
    features = image_features_fn(reference_model)
    _, images = case(fixture, "two")
    rows = np.array([[40, 41, 42, 7, 8, 9, 10, 11, 12, 13, 20, 30], [1, 0, 63]], dtype=object)
    before = np.asarray(engine.image_pool)
    for image, where in zip(images, rows, strict=True):
        engine.encode(image, np.asarray(where, np.int32))
    pool = np.asarray(engine.image_pool)
    for image, where in zip(images, rows, strict=True):
        np.testing.assert_array_equal(pool[list(where)], features(image.pixel_values, image.image_grid_thw))
    untouched = np.setdiff1d(np.arange(len(pool)), np.concatenate([list(r) for r in rows]))
    np.testing.assert_array_equal(pool[untouched], before[untouched])


@pytest.mark.slow
def test_greedy_with_images_equals_whole_sequence_scoring(fixture, reference_model, engine, scheduler):
    """One and two images, their placeholder runs cut by 8-token prefill chunks, alone and beside text requests
    (one greedy, one sampled) and each other; nothing compiles after warm-up."""
    compiled = engine.compilations
    assert compiled == len(engine.shapes) + len(engine.image_buckets)
    requests = []
    for name in ("one", "two"):
        prompt, images = case(fixture, name)
        assert any(start // CHUNK != (start + length - 1) // CHUNK for start, length in placeholder_runs(prompt, 300))
        requests.append(Request(name, prompt, max_tokens=6, temperature=0.0, images=images))
    rng = np.random.default_rng(0)
    requests.append(Request("text", tuple(rng.integers(0, 300, 19).tolist()), max_tokens=6, temperature=0.0))
    requests.append(Request("sampled", tuple(rng.integers(0, 300, 11).tolist()), max_tokens=6, seed=3))
    alone = {r.id: run(scheduler, [r])[r.id] for r in requests}
    for request in requests[:2]:
        assert alone[request.id] == greedy_reference(reference_model, request.prompt_token_ids, request.images, 6)
    assert run(scheduler, requests) == alone
    assert run(scheduler, requests[::-1]) == alone
    assert engine.compilations == compiled
    big = RequestImage(np.zeros((TILES, 8, 8, 3), np.float32), np.array([[1, 4, 4]]))
    with pytest.raises(Rejected, match="80 tiles can never fit this server's image feature pool of 64 rows") as refused:
        scheduler.submit(Request("big", (1, *[IMAGE_TOKEN] * TILES) * 5, images=(big,) * 5), lambda delta: None)
    assert refused.value.code is Code.RESOURCE_EXHAUSTED
    stats = scheduler.stats()
    assert stats.running == 0 and len(scheduler._free_rows) == engine.image_limits.pool_rows


@pytest.mark.slow
def test_a_preempted_request_keeps_its_images(fixture, engine, scheduler):
    """Both sequences grow past position 128 and 3 pages hold only one of them there: the later one is preempted and
    recomputed, its placeholders reading the same feature rows, and its tokens are those it gets alone."""
    requests = []
    for name in ("one", "two"):
        prompt, images = case(fixture, name)
        requests.append(Request(name, prompt, max_tokens=115, temperature=0.0, ignore_eos=True, images=images))
    alone = {r.id: run(scheduler, [r])[r.id] for r in requests}
    before = scheduler.stats().preemptions
    assert run(scheduler, requests) == alone
    assert scheduler.stats().preemptions > before


@pytest.mark.slow
def test_images_in_cached_pages_are_not_encoded_again(fixture, reference_model, engine, scheduler, monkeypatch):
    """A request that resumes after a cached page holding an image's placeholders neither encodes that image nor
    takes rows for it, and continues as whole-sequence scoring does; its image after the cached page is encoded."""
    prompt, images = case(fixture, "two")
    rng = np.random.default_rng(5)
    text = tuple(rng.integers(0, IMAGE_TOKEN, PAGE_SIZE + 4 - len(prompt)).tolist())
    first = Request("first", prompt + text, max_tokens=6, temperature=0.0, images=images)
    third = (*rng.integers(0, IMAGE_TOKEN, 3).tolist(), *[IMAGE_TOKEN] * images[1].tiles, 7, 8)
    second = Request("second", prompt + text[:-2] + third, max_tokens=6, temperature=0.0, images=(*images, images[1]))
    encoded = []
    encode = engine.encode
    monkeypatch.setattr(engine, "encode", lambda image, rows: encoded.append(image) or encode(image, rows))
    run(scheduler, [first])
    assert encoded == list(images)
    encoded.clear()
    tokens = run(scheduler, [second])["second"]
    assert encoded == [images[1]]  # the third image's, after the cached page; the first two are in it
    assert tokens == greedy_reference(reference_model, second.prompt_token_ids, second.images, 6)
    assert len(scheduler._free_rows) == engine.image_limits.pool_rows


def test_requests_with_images_that_do_not_fit_are_refused(fixture, engine):
    prompt, images = case(fixture, "two")
    refusals = {
        "runs of image placeholders (token 300) hold [12, 4] tokens, the images have [12, 3] tiles": Request(
            "a", (*prompt[:21], 300, *prompt[21:]), images=images
        ),
        "hold [12] tokens, the images have [12, 3]": Request("b", prompt[:20], images=images),
        "more than the 16 a request may carry": Request("c", prompt, images=images * 9),
        "image_grid_thw must be [[1, rows, columns]]": Request(
            "d", prompt, images=(images[0], RequestImage(images[1].pixel_values, np.array([[1, 3]])))
        ),
    }
    for message, request in refusals.items():
        with pytest.raises(Rejected, match=re.escape(message)) as refused:
            validate(request, engine.text, engine.image_limits)
        assert refused.value.code is Code.INVALID_ARGUMENT


def test_the_front_end_places_each_image_after_its_marker(tmp_path, fixture):
    """A text prompt's and a conversation's image markers are followed by their images' runs; token-id prompts
    must hold the runs already."""
    config = load_config(MM / "hf")
    tokenizer = Tokenizer(build_tokenizer(config.text))
    write_image(tmp_path / "a.png", (20, 28))
    write_image(tmp_path / "b.png", (7, 17))
    limits = image_limits(config.vision, config.image_token_id, 4, TILES)
    source = ImageSource(tmp_path, ImageProcessorSettings(tile_height=8, tile_width=8), limits)
    marker = tokenizer.special_tokens[IMAGE_MARKER]

    chat = ChatTemplate(DEFAULT_TEMPLATE.read_text())

    def read(line: dict) -> Request:
        return request_from_json(json.dumps(line), tokenizer, config.text, chat, source)

    request = read({"id": 1, "prompt": f"see {IMAGE_MARKER} and {IMAGE_MARKER}!", "images": ["a.png", "b.png"]})
    runs = placeholder_runs(request.prompt_token_ids, IMAGE_TOKEN)
    assert [length for _, length in runs] == [12, 3]
    assert all(request.prompt_token_ids[start - 1] == marker for start, _ in runs)
    assert request.prompt_token_ids[: runs[0][0] - 1] == tuple(tokenizer.encode("see "))
    content = [{"type": "text", "text": "what is this?"}, {"type": "image"}]
    request = read({"id": 2, "messages": [{"role": "user", "content": content}], "images": ["b.png"]})
    ((start, length),) = placeholder_runs(request.prompt_token_ids, IMAGE_TOKEN)
    assert length == 3 and request.prompt_token_ids[start - 1] == marker
    assert tokenizer.decode(request.prompt_token_ids[start + 3 :]).startswith("<|end_message|>")
    with pytest.raises(Rejected, match="'messages' hold 1 image parts and no 'images' to fill them"):
        read({"id": 5, "messages": [{"role": "user", "content": content}]})
    with pytest.raises(Rejected, match="the prompt marks 1 images"):
        read({"id": 3, "prompt": f"{IMAGE_MARKER}", "images": ["a.png", "b.png"]})
    with pytest.raises(Rejected, match="hold \\[3\\] tokens, the images have \\[12\\] tiles"):
        read({"id": 4, "prompt_token_ids": [1, *[IMAGE_TOKEN] * 3, 2], "images": ["a.png"]})


def write_image(path: Path, size: tuple[int, int], seed: int = 0) -> None:
    """A random RGB PNG of size (height, width)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, mm_checkpoint) -> Path:
    """The four-layer tiny_mm with 8-pixel tiles in its processor settings, a tokenizer and the chat template."""
    out = tmp_path_factory.mktemp("tiny_mm")
    for file in mm_checkpoint.iterdir():
        shutil.copy(file, out / file.name)
    (out / "processor_config.json").write_text(json.dumps({"image_processor": {"size": 8}}))
    write_tokenizer(out, build_tokenizer(load_config(out).text))
    return out


def generate(checkpoint: Path, directory: Path, lines: list, *options: str) -> tuple[int, list[dict]]:
    (directory / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    code = main(["--checkpoint", str(checkpoint), "--input", str(directory / "in.jsonl"), "--output",
                 str(directory / "out.jsonl"), "--dtype", "float32", "--chunk", str(CHUNK), "--max-image-tiles",
                 str(TILES), "--quiet", *options])  # fmt: skip
    out = directory / "out.jsonl"
    return code, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.slow
def test_generate_jsonl_with_image_paths(tmp_path, checkpoint, reference_model):
    """Paths relative to the JSONL file's directory or absolute; the greedy tokens are whole-sequence scoring's."""
    (tmp_path / "pictures").mkdir()
    write_image(tmp_path / "pictures" / "a.png", (20, 28))
    write_image(tmp_path / "b.png", (7, 17), seed=1)
    settings = ImageProcessorSettings.from_checkpoint(checkpoint)
    images = tuple(
        RequestImage(*process_image_file(p, settings)) for p in (tmp_path / "pictures/a.png", tmp_path / "b.png")
    )
    prompt = [5, 6, *[IMAGE_TOKEN] * 12, 7, *[IMAGE_TOKEN] * 3, 8]
    lines = [
        {"id": "ids", "prompt_token_ids": prompt, "images": ["pictures/a.png", str(tmp_path / "b.png")],
         "max_tokens": 5, "temperature": 0},
        {"id": "chat", "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
         "images": ["b.png"], "max_tokens": 3},
    ]  # fmt: skip
    code, results = generate(checkpoint, tmp_path, lines)
    assert code == 0
    assert results[0]["token_ids"] == greedy_reference(reference_model, tuple(prompt), images, 5)
    assert results[1]["finish_reason"] in ("length", "stop")


def test_a_batch_run_compiles_encode_programs_up_to_its_largest_image():
    """A batch run knows its images: its encode buckets stop at the largest one's tiles, its feature pool is what the
    limits give (as many images in flight), and without images it compiles none."""
    rng = np.random.default_rng()
    tiles = rng.integers(1, 300, 5)
    requests = [Request(i, (1,), images=tuple(RequestImage(np.zeros((t, 1)), None) for t in tiles[i:])) for i in (0, 3)]
    options = encode_programs_for([Request("text", (1,)), *requests], 512)
    assert options == {"max_image_tiles": tiles.max(), "image_feature_tokens": 4 * 512}
    assert image_buckets(options["max_image_tiles"])[-1] == tiles.max()
    assert encode_programs_for(requests, 512, pool_rows=900)["image_feature_tokens"] == 900
    assert encode_programs_for([Request("text", (1,))], 512) == {"max_images": 0}
    assert encode_programs_for(requests, tiles.max() - 1)["max_image_tiles"] == tiles.max() - 1  # the largest: refused


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"images": ["missing.png"]}, "line 2: images[0] (missing.png): cannot read image file"),
        ({"images": ["corrupt.png"]}, "line 2: images[0] (corrupt.png): "),
        ({"images": ["a.png", "a.png"]}, "line 2: the prompt's runs of image placeholders (token 300) hold [12] "
         "tokens, the images have [12, 12] tiles"),
        ({"images": "a.png"}, "line 2: 'images' must be a list of image file paths"),
    ],
)  # fmt: skip
def test_bad_image_lines_are_named(tmp_path, capsys, checkpoint, line, message):
    write_image(tmp_path / "a.png", (20, 28))
    (tmp_path / "corrupt.png").write_bytes((tmp_path / "a.png").read_bytes()[:60])
    good = {"id": 0, "prompt_token_ids": [1, 2]}
    code, results = generate(
        checkpoint, tmp_path, [good, {"id": 1, "prompt_token_ids": [1, *[IMAGE_TOKEN] * 12]} | line]
    )
    assert code == 2 and results == []
    assert message in capsys.readouterr().err


def test_a_feature_pool_smaller_than_an_image_is_refused(tmp_path, capsys, checkpoint):
    code, _ = generate(checkpoint, tmp_path, [{"id": 0, "prompt_token_ids": [1]}], "--image-feature-tokens", "8")
    assert code == 2
    assert "image_feature_tokens 8 cannot hold one image of max_image_tiles 16" in capsys.readouterr().err


def test_a_text_only_model_refuses_images(tmp_path, capsys):
    write_image(tmp_path / "a.png", (20, 28))
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 0, "prompt_token_ids": [1, 2], "images": ["a.png"]}) + "\n")
    code = main(["--checkpoint", str(PARITY / "tiny_text" / "hf"), "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl")])  # fmt: skip
    assert code == 2
    assert "line 1: this model takes no images" in capsys.readouterr().err


@pytest.mark.slow
def test_speculative_decoding_with_images_is_lossless(fixture, mm_checkpoint, reference_model):
    """The random tiny_mm's DSpark draft: greedy tokens of a request with images under `--speculative dspark` are
    whole-sequence scoring's (the draft reads the target's hidden states of the image placeholders too)."""
    reference = reference_model
    model = load_causal_lm(mm_checkpoint, np.float32)[1]
    layout = CacheLayout(2, 2, 2, CHUNK)
    mesh = make_mesh("tp1", model.config)
    engine = Engine(model, layout, mesh, num_top=MAX_LOGPROBS, speculative="dspark", max_image_tiles=TILES)
    scheduler = Scheduler(engine)
    scheduler.warm_up()
    scheduler.start()
    requests = []
    for name in ("one", "two"):
        prompt, images = case(fixture, name)
        requests.append(Request(name, prompt, max_tokens=10, temperature=0.0, images=images))
    try:
        tokens = run(scheduler, requests)
        assert scheduler.stats().speculative_rounds > 0
    finally:
        scheduler.stop()
    for request in requests:
        assert tokens[request.id] == greedy_reference(reference, request.prompt_token_ids, request.images, 10)


@pytest.mark.slow
def test_data_parallel_replicas_read_the_replicated_pool(tmp_path):
    """A random three-layer image model (tiny_mm's tower on the TINY text stack, whose heads split two ways): over
    dp2tp2, each replica's tokens read the feature pool every device holds whole, and the results are one device's."""
    vision = json.loads((MM / "hf" / "config.json").read_text())["vision_config"] | {"text_hidden_size": 16}
    config = {"model_type": "inkling2", "image_token_id": 50, "text_config": TINY, "vision_config": vision}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = write_checkpoint(tmp_path / "config.json", tmp_path / "mm", experts="fp32")
    pixels = np.random.default_rng(0).uniform(-1, 1, (6, 8, 8, 3)).astype(np.float32)
    image = RequestImage(pixels, np.array([[1, 2, 3]]))
    requests = [
        Request(0, (1, 2, *[50] * 6, 4, 5), max_tokens=5, temperature=0.0, images=(image,)),
        Request(1, (7, 8, 9), max_tokens=5, temperature=0.0),
        Request(2, (3, *[50] * 6), max_tokens=5, temperature=0.0, images=(image,)),
    ]
    results = []
    for mesh, slots in (("tp1", 3), ("dp2tp2", 2)):
        model = load_causal_lm(out, np.float32)[1]
        results.append(
            generate_requests(model, requests, max_num_seqs=slots, chunk=4, mesh=make_mesh(mesh, model.config))
        )
    assert results[1] == results[0]
