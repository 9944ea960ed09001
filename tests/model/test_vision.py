"""The image tower and its merge into the text model: parity with transformers 5.23.0 on tiny_mm's image cases
(tests/fixtures/parity/tiny_mm/images.npz, written by tests/parity/make_fixtures.py), loading in both layouts,
sharding, and refusals of inputs and checkpoints that do not fit."""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_configs import FOUR_LAYERS
from paths import PARITY, TINY_CONFIG

from inkling_jax import score
from inkling_jax.checkpoint import CheckpointError, load_causal_lm
from inkling_jax.checkpoint.dummy import dummy_model
from inkling_jax.checkpoint.loader import named_parameters
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles, write_safetensors
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import ConfigError, load_config, parse_config
from inkling_jax.forward import image_features_fn, multimodal_logits
from inkling_jax.model import vision
from inkling_jax.model.vision import ImageInputError
from inkling_jax.sharding import MODEL, make_mesh

MM = PARITY / "tiny_mm"
CASES = ("one", "two")
LAYOUTS = ("hf", "original")
IMAGE_TOKEN = 300


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module")
def images() -> dict[str, np.ndarray]:
    return dict(np.load(MM / "images.npz"))


@pytest.fixture(scope="module")
def models() -> dict:
    return {layout: load_causal_lm(MM / layout, jnp.float32)[1] for layout in LAYOUTS}


def _case(images: dict, case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return images[f"{case}_input_ids"], images[f"{case}_pixel_values"], images[f"{case}_image_grid_thw"]


def test_cases_cover_padding_resampling_and_two_sizes(images):
    """The images need padding, their patch grids are both larger and smaller than the position table, and the
    two-image prompt holds images of different sizes, each as one contiguous placeholder run."""
    grids = images["two_image_grid_thw"]
    assert grids.tolist() == [[1, 3, 4], [1, 1, 3]]
    ids = images["two_input_ids"]
    runs = np.flatnonzero(np.diff(np.concatenate([[0], ids == IMAGE_TOKEN, [0]])))
    assert (runs[1::2] - runs[::2]).tolist() == [12, 3]
    assert images["one_image_grid_thw"].tolist() == [[1, 3, 4]]
    assert np.isclose(images["two_pixel_values"], -1 - 1 / 127.5).any()  # padding: -1 on the 0-255 scale


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_features_match_reference(case, layout, images, models):
    _, pixels, grid = _case(images, case)
    got = np.asarray(image_features_fn(models[layout])(pixels, grid))
    want = images[f"{case}_features_f32"]
    assert got.shape == want.shape and got.dtype == np.float32
    assert relative_error(got, want) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", CASES)
def test_float32_logits_match_reference(case, layout, images, models):
    ids, pixels, grid = _case(images, case)
    got = np.asarray(multimodal_logits(models[layout], ids, pixels, grid))
    want = images[f"{case}_logits_f32"]
    assert got.shape == want.shape
    assert relative_error(got, want) < 1e-4


def test_features_enter_only_at_placeholders(images, models):
    """Text rows keep their normed embeddings (features skip embed_norm); placeholder rows hold the features."""
    model = models["hf"]
    ids, pixels, grid = _case(images, "two")
    features = image_features_fn(model)(pixels, grid)
    embedded = np.asarray(model.embed(jnp.asarray(ids[None]), features))[0]
    text = np.asarray(model.model.embed_tokens(jnp.asarray(ids[None])))[0]
    placeholder = ids == IMAGE_TOKEN
    np.testing.assert_array_equal(embedded[~placeholder], text[~placeholder])
    np.testing.assert_array_equal(embedded[placeholder], np.asarray(features))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bfloat16_tower_follows_reference(case, images):
    """bf16 rounds differently from the reference's CPU kernels in places, and the tiny text model is chaotic in
    bf16 (see tests/parity/README.md): the features stay within bf16's error of the reference's bf16 features,
    and the logits are finite and nearer the reference's bf16 logits than its float32 ones are."""
    _, model = load_causal_lm(MM / "hf", jnp.bfloat16)
    ids, pixels, grid = _case(images, case)
    features = image_features_fn(model)(pixels, grid)
    assert features.dtype == jnp.bfloat16
    got = np.asarray(features.astype(jnp.float32))
    want, f32 = images[f"{case}_features_bf16"], images[f"{case}_features_f32"]
    assert np.abs(got - want).max() < 0.5 * np.abs(f32 - want).max() + 0.02 * np.abs(want).max()
    logits = np.asarray(multimodal_logits(model, ids, pixels, grid))
    assert np.isfinite(logits).all()
    want, f32 = images[f"{case}_logits_bf16"], images[f"{case}_logits_f32"]
    assert np.abs(logits - want).mean() < np.abs(f32 - want).mean()


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention runs on a GPU")
def test_fused_attention_keeps_images_apart_within_bf16_rounding():
    """The tower's fused attention on a GPU (cuDNN) over two images and a padding segment: each token attends within
    its own image only, and every output is within bf16 rounding of the reference's arithmetic."""
    rng = np.random.default_rng(7)
    length, heads, dim = 300, 4, 64
    q, k, v = (jnp.asarray(rng.normal(size=(length, heads, dim)), jnp.bfloat16) for _ in range(3))
    segments = jnp.asarray(np.repeat([0, 1, 2], [37, 200, 63]), jnp.int32)
    got = np.asarray(vision.fused_image_attention(q, k, v, segments, dim**-0.5), np.float32)
    want = np.asarray(vision.reference_image_attention(q, k, v, segments, dim**-0.5), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    alone = np.asarray(vision.fused_image_attention(q[37:237], k[37:237], v[37:237], segments[37:237], dim**-0.5))
    np.testing.assert_allclose(got[37:237], alone.astype(np.float32), atol=1e-2, rtol=1e-2)


def test_placeholder_count_mismatch_is_refused(images, models):
    model = models["hf"]
    ids, pixels, grid = _case(images, "two")
    fewer = np.delete(ids, np.flatnonzero(ids == IMAGE_TOKEN)[0])
    with pytest.raises(ImageInputError, match="14 image placeholders .* 15 features"):
        multimodal_logits(model, fewer, pixels, grid)
    features = image_features_fn(model)(pixels[:12], grid[:1])
    with pytest.raises(ImageInputError, match="15 image placeholders .* 12 features"):
        model(jnp.asarray(ids[None]), image_features=features)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p, g: (p[:, :4], g), r"pixel_values must be \[tiles, 8, 8, 3\]"),
        (lambda p, g: (p[:-1], g), "image_grid_thw counts 15 tiles, pixel_values holds 14"),
        (lambda p, g: (p, g[:, :2]), r"image_grid_thw must be \[images, 3\]"),
        (lambda p, g: (p, g * np.array([0, 1, 1])), "positive integers"),
        (lambda p, g: (p, g.astype(np.float32)), "positive integers"),
    ],
)
def test_images_that_do_not_fit_are_refused(change, message, images, models):
    ids, pixels, grid = _case(images, "two")
    pixels, grid = change(pixels, grid)
    with pytest.raises(ImageInputError, match=message):
        multimodal_logits(models["hf"], ids, pixels, grid)


@pytest.mark.parametrize(
    ("rope", "message"),
    [({"rope_type": "default"}, "rope_type must be 'axial'"), ({"rope_theta": -1.0}, "rope_theta must be positive")],
)
def test_rope_other_than_axial_is_refused(rope, message):
    with pytest.raises(ConfigError, match=f"vision_config.rope_parameters.{message}"):
        parse_config({"model_type": "inkling2", "vision_config": {"rope_parameters": rope}})


def test_a_text_only_model_refuses_images(images):
    _, text_only = load_causal_lm(PARITY / "tiny_text" / "hf", jnp.float32)
    assert text_only.vision_tower is None
    ids, pixels, grid = _case(images, "one")
    with pytest.raises(ImageInputError, match="no image tower"):
        multimodal_logits(text_only, ids, pixels, grid)


def _score_request(tmp_path: Path, ids: np.ndarray, pictures: list[str]) -> Path:
    """REQ.json for `score`, its images copied into a folder beside it and named relative to it."""
    (tmp_path / "pictures").mkdir(exist_ok=True)
    for name in pictures:
        shutil.copyfile(MM / "images" / name, tmp_path / "pictures" / name)
    request = {"prompt_token_ids": ids.tolist(), "images": [f"pictures/{name}" for name in pictures]}
    (tmp_path / "req.json").write_text(json.dumps(request))
    return tmp_path / "req.json"


def _run_score(checkpoint: Path, request: Path, capsys) -> tuple[int, str]:
    code = score.main(["--checkpoint", str(checkpoint), "--input", str(request), "--output", str(request) + ".npy"])
    return code, capsys.readouterr().err


@pytest.mark.slow
def test_score_cli_reads_images_named_beside_the_request(images, tmp_path, capsys):
    """The image files (PNG) go through the image processor with the checkpoint's settings (8-pixel tiles) into the
    logits transformers gave for their pixel values."""
    ids = images["two_input_ids"]
    request = _score_request(tmp_path, ids, ["two_0.png", "two_1.png"])
    code, err = _run_score(MM / "original", request, capsys)
    assert code == 0, err
    got = np.load(str(request) + ".npy")
    assert got.dtype == np.float32 and relative_error(got, images["two_logits_f32"]) < 1e-4


@pytest.mark.parametrize(
    ("pictures", "edit", "message"),
    [
        (["two_0.png"], None, "holds 2 runs of the image placeholder .token 300. and the request names 1 images"),
        (
            ["two_1.png", "two_0.png"],
            None,
            r"images\[0\] .pictures/two_1.png. has 3 tiles, its placeholder run at token 4 has 12",
        ),
        (["two_0.png", "gone.png"], None, "images\\[1\\] .pictures/gone.png.: cannot read image file"),
        (
            ["two_0.png", "two_1.png"],
            lambda r: {**r, "images": "two_0.png"},
            "'images' must be a list of image file paths",
        ),
        (["two_0.png", "two_1.png"], lambda r: {**r, "pixels": []}, r"unknown fields \['pixels'\]"),
        (["two_0.png", "two_1.png"], lambda r: {"ids": r["prompt_token_ids"]}, "an object with 'prompt_token_ids'"),
    ],
)
def test_score_cli_names_what_is_wrong_with_a_request(pictures, edit, message, images, tmp_path, capsys):
    request = _score_request(tmp_path, images["two_input_ids"], [p for p in pictures if p != "gone.png"])
    body = json.loads(request.read_text())
    body["images"] = [f"pictures/{name}" for name in pictures]
    request.write_text(json.dumps(edit(body) if edit else body))
    code, err = _run_score(MM / "hf", request, capsys)
    assert code == 2 and re.search(message, err), err
    assert not Path(str(request) + ".npy").exists()


def test_score_cli_refuses_images_for_a_text_only_model(images, tmp_path, capsys):
    ids = np.arange(1, 30)  # no placeholder run of tiny_text's vocabulary either
    code, err = _run_score(PARITY / "tiny_text" / "hf", _score_request(tmp_path, ids, ["one_0.png"]), capsys)
    assert code == 2 and "takes no images" in err


def _copy_without(source: Path, out: Path, dropped: str) -> Path:
    files = CheckpointFiles(source)
    tensors = {name: np.array(files.read(name)) for name in files if name != dropped}
    assert len(tensors) == len(list(files)) - 1
    write_safetensors(out / "model.safetensors", tensors)
    (out / "config.json").write_text((source / "config.json").read_text())
    return out


@pytest.mark.parametrize(
    ("layout", "dropped"),
    [
        ("hf", "model.vision_tower.layers.1.mlp.fc1.bias"),
        ("original", "model.visual.backbone.layers.1.mlp.c_fc.bias"),
        ("original", "model.visual.backbone.embeddings.position_embedding"),
        ("original", "model.visual.proj_out.weight"),
    ],
)
def test_a_missing_tower_tensor_is_named(layout, dropped, tmp_path):
    with pytest.raises(CheckpointError, match=f"missing tensors for {dropped.replace('.', r'\.')} "):
        load_causal_lm(_copy_without(MM / layout, tmp_path, dropped), jnp.float32)


def test_tower_tensors_without_a_vision_config_are_refused(tmp_path):
    files = CheckpointFiles(PARITY / "tiny_text" / "original")
    tensors = {name: np.array(files.read(name)) for name in files}
    tensors["model.visual.proj_in.weight"] = np.ones((4, 4), np.float32)
    write_safetensors(tmp_path / "model.safetensors", tensors)
    (tmp_path / "config.json").write_text((PARITY / "tiny_text" / "original" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="'model.visual.proj_in.weight' belongs to an image tower"):
        load_causal_lm(tmp_path, jnp.float32)


def _multimodal_config(tmp_path: Path) -> Path:
    """configs/tiny.json's text model (no draft) in four layers (a third of twelve layers' compile) with a tiny image
    tower: tp2 and tp4 fit the text model and split the tower's MLP (128) and projector (48) widths; its 2 heads split
    on tp2 and are replicated on tp4."""
    text = {k: v for k, v in json.loads(TINY_CONFIG.read_text()).items() if k not in ("model_type", "dspark_config")}
    text |= FOUR_LAYERS
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "patch_size": 4,
        "posemb_grid_size": 4,
        "projection_hidden_dim": 48,
        "text_hidden_size": text["hidden_size"],
    }
    raw = {"model_type": "inkling2", "text_config": text, "vision_config": vision, "image_token_id": IMAGE_TOKEN}
    path = tmp_path / "mm.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    """A random multimodal checkpoint written in both layouts."""
    root = tmp_path_factory.mktemp("synthetic_mm")
    config = _multimodal_config(root)
    layouts = ("original", "transformers")
    return {layout: write_checkpoint(config, root / layout, layout=layout, experts="fp32") for layout in layouts}


def _vision_params(model: nnx.Module) -> dict[str, jax.Array]:
    """The tower's parameters as checkpoints name them (a layer's rows by `vision_tower.layers.{i}.…`)."""
    return {name: value for name, value in named_parameters(model).items() if name.startswith("vision_tower.")}


def test_synthetic_tower_loads_alike_from_both_layouts(synthetic):
    _, original = load_causal_lm(synthetic["original"], jnp.float32)
    _, transformers = load_causal_lm(synthetic["transformers"], jnp.float32)
    assert any(name.startswith("model.visual.") for name in CheckpointFiles(synthetic["original"]))
    assert any(name.startswith("model.vision_tower.") for name in CheckpointFiles(synthetic["transformers"]))
    got, want = _vision_params(transformers), _vision_params(original)
    assert len(got) == 4 + 2 + 2 * 18 + 2  # embeddings, pre-LN, 2 layers, merger
    assert got.keys() == want.keys()
    for path, variable in got.items():
        np.testing.assert_array_equal(np.asarray(variable), np.asarray(want[path]), err_msg=path)
    scales = np.asarray(got["vision_tower.layers.0.lambda_1"])
    assert ((scales > 0.05) & (scales < 0.3)).all()


def _random_images(model: nnx.Module) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two images (3x2 and 1x4 tiles) and a prompt with their placeholders."""
    rng = np.random.default_rng(3)
    grid = np.array([[1, 3, 2], [1, 1, 4]], np.int32)
    pixels = rng.uniform(-1, 1, (10, 8, 8, 3)).astype(np.float32)
    text = rng.integers(0, 299, 9)
    ids = np.concatenate([text[:3], np.full(6, IMAGE_TOKEN), text[3:5], np.full(4, IMAGE_TOKEN), text[5:]])
    return ids, pixels, grid


@pytest.mark.slow
@pytest.mark.parametrize("mesh_spec", ["tp2", "tp4"])
def test_sharded_tower_matches_unsharded(mesh_spec, synthetic):
    """Read into the mesh's shards (heads, MLP and projector widths split where tp divides them), the tower gives
    the unsharded features, and (tp2) the model the unsharded logits."""
    checkpoint = synthetic["original"]
    _, whole = load_causal_lm(checkpoint, jnp.float32)
    mesh = make_mesh(mesh_spec, load_config(checkpoint).text)
    _, sharded = load_causal_lm(checkpoint, jnp.float32, mesh)
    layers = sharded.vision_tower.layers  # stacked: [layers, out, in]
    assert layers.self_attn.q_proj.weight[...].sharding.spec[1] == (MODEL if mesh_spec == "tp2" else None)
    assert layers.mlp.fc1.weight[...].sharding.spec[1] == MODEL
    assert layers.mlp.fc2.weight[...].sharding.spec[2] == MODEL
    ids, pixels, grid = _random_images(whole)
    want_features = np.asarray(image_features_fn(whole)(pixels, grid))
    with jax.set_mesh(mesh):
        got_features = np.asarray(image_features_fn(sharded)(pixels, grid))
        got_logits = np.asarray(multimodal_logits(sharded, ids, pixels, grid)) if mesh_spec == "tp2" else None
    assert relative_error(got_features, want_features) < 1e-5
    if got_logits is not None:  # the text model's sharding is test_sharding.py's; here the merge under a mesh
        assert relative_error(got_logits, np.asarray(multimodal_logits(whole, ids, pixels, grid))) < 1e-4


@pytest.mark.slow
def test_dummy_model_builds_the_tower_in_its_shards(synthetic):
    config = load_config(synthetic["original"])
    mesh = make_mesh("tp2", config.text)
    model = dummy_model(config, jnp.bfloat16, mesh)
    _, loaded = load_causal_lm(synthetic["original"], jnp.bfloat16)
    built, expected = _vision_params(model), _vision_params(loaded)
    assert built.keys() == expected.keys()
    for path, variable in built.items():
        assert (variable.shape, variable.dtype) == (expected[path].shape, expected[path].dtype), path
    assert len(built) == 44
    assert model.vision_tower.layers.mlp.fc1.weight[...].sharding.spec[1] == MODEL
    _, pixels, grid = _random_images(model)
    with jax.set_mesh(mesh):
        features = np.asarray(image_features_fn(model)(pixels, grid).astype(jnp.float32))
    assert features.shape == (10, 64) and np.isfinite(features).all() and features.std() > 0


@pytest.mark.slow
def test_orbax_round_trips_the_tower(synthetic, tmp_path):
    from inkling_jax.checkpoint import load_model, orbax_io

    _, model = load_causal_lm(synthetic["original"], jnp.float32)
    saved = orbax_io.save(model, synthetic["original"] / "config.json", tmp_path / "orbax")
    _, restored = load_model(saved, jnp.float32)
    got, want = _vision_params(restored), _vision_params(model)
    assert got.keys() == want.keys()
    for path, variable in got.items():
        np.testing.assert_array_equal(np.asarray(variable), np.asarray(want[path]), err_msg=path)
