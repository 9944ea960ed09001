"""Safetensors IO and checkpoint loading: round trips on random data, and clear errors."""

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_edits import edited_copy

from inkling_jax.checkpoint import CheckpointError, load_causal_lm
from inkling_jax.checkpoint.loader import checkpoint_parameters, named_parameters
from inkling_jax.checkpoint.names import deinterleave_rows
from inkling_jax.checkpoint.safetensors_io import (
    CheckpointFiles,
    SafetensorsError,
    write_safetensors,
    write_sharded,
)
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import parse_config

TINY = {
    "model_type": "inkling2_text", "vocab_size": 64, "unpadded_vocab_size": 60, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 2, "swa_head_dim": 4, "sliding_window_size": 4, "d_rel": 2, "rel_extent": 5,
    "moe_intermediate_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
    "eos_token_id": 3,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    (root / "tiny.json").write_text(json.dumps(TINY))
    return write_checkpoint(root / "tiny.json", root / "ckpt", seed=7, experts="fp32", layout="transformers")


def test_safetensors_round_trip_every_dtype(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.normal(size=(3, 5)).astype(np.float32),
        "bf16": rng.normal(size=(4, 2, 3)).astype(ml_dtypes.bfloat16),
        "e4m3": rng.normal(size=(7,)).astype(ml_dtypes.float8_e4m3fn),
        "i32": rng.integers(-100, 100, size=(2, 2)).astype(np.int32),
        "scalar": np.array(1.5, np.float32),
    }
    write_safetensors(tmp_path / "a.safetensors", tensors)
    files = CheckpointFiles(tmp_path / "a.safetensors")
    assert files.names() == sorted(tensors)
    for name, array in tensors.items():
        read = files.read(name)
        assert read.dtype == array.dtype and read.shape == array.shape
        assert read.tobytes() == array.tobytes(), name


def test_sharded_checkpoint_reads_through_index(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {f"t{i}": rng.normal(size=(i + 1, 3)).astype(np.float32) for i in range(5)}
    write_sharded(tmp_path, tensors, num_shards=2)
    assert len(list(tmp_path.glob("model-*-of-00002.safetensors"))) == 2
    files = CheckpointFiles(tmp_path)
    for name, array in tensors.items():
        np.testing.assert_array_equal(files.read(name), array)


def test_broken_files_raise_named_errors(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(SafetensorsError, match="model.safetensors"):
        CheckpointFiles(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "gone.safetensors"}}))
    with pytest.raises(SafetensorsError, match="gone.safetensors"):
        CheckpointFiles(tmp_path)
    with pytest.raises(SafetensorsError, match="no model.safetensors"):
        CheckpointFiles(tmp_path / "..")


def _raw_safetensors(path: Path, header: dict, data: bytes = b"") -> None:
    encoded = json.dumps(header).encode()
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "F32", "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "F32", "shape": None, "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "F32", "shape": [-1, -1], "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "malformed header entry"),
        ({"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}, "unsupported dtype 'Q4'"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, r"byte range 0..4 does not hold \[2\]"),
        ("not an object", "malformed header entry"),
    ],
)
def test_malformed_header_entries_are_named(tmp_path, entry, message):
    _raw_safetensors(tmp_path / "model.safetensors", {"w": entry}, b"\0" * 4)
    with pytest.raises(SafetensorsError, match=f"tensor 'w' .*{message}|tensor 'w' has {message}"):
        CheckpointFiles(tmp_path)


@pytest.mark.parametrize("weight_map", [["w"], {"w": None}, "x"])
def test_malformed_index_is_named(tmp_path, weight_map):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(SafetensorsError, match="weight_map"):
        CheckpointFiles(tmp_path)


def test_checkpoint_must_be_a_directory(tiny_checkpoint):
    with pytest.raises(CheckpointError, match="is not a checkpoint directory"):
        load_causal_lm(tiny_checkpoint / "model.safetensors", jnp.float32)


@pytest.mark.slow
def test_key_clip_tensors_are_ignored_like_transformers(tiny_checkpoint, tmp_path):
    edited = edited_copy(
        tiny_checkpoint, tmp_path, lambda t: {**t, "model.layers.0.self_attn.k_l2_clip.scale": np.ones(4)}
    )
    _, model = load_causal_lm(edited, jnp.float32)
    _, reference = load_causal_lm(tiny_checkpoint, jnp.float32)
    ids = jnp.asarray([[3, 14, 15, 9, 26]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(reference(ids)))


def test_deinterleave_rows_splits_gate_and_up():
    rng = np.random.default_rng(2)
    gate, up = rng.normal(size=(3, 4, 5)), rng.normal(size=(3, 4, 5))
    interleaved = np.empty((3, 8, 5))
    interleaved[:, 0::2], interleaved[:, 1::2] = gate, up
    np.testing.assert_array_equal(deinterleave_rows(interleaved), np.concatenate([gate, up], axis=1))


def test_load_fills_every_parameter_from_the_file(tiny_checkpoint):
    _, model = load_causal_lm(tiny_checkpoint, jnp.float32)
    files = CheckpointFiles(tiny_checkpoint)
    params = named_parameters(model)
    assert len(params) == len(files.names())
    for path, value in params.items():
        np.testing.assert_array_equal(np.asarray(value), files.read(path))


def test_bfloat16_load_keeps_fp32_parameters(tiny_checkpoint):
    _, model = load_causal_lm(tiny_checkpoint, jnp.bfloat16)
    params = named_parameters(model)
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == jnp.bfloat16
    assert params["model.layers.1.mlp.experts.gate_up_proj"].dtype == jnp.bfloat16
    for fp32 in (
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.gate.e_score_correction_bias",
        "model.layers.0.post_mlp_convolution.conv1d.weight",
        "model.layers.0.self_attn.k_sconv.conv1d.weight",
        "model.layers.1.attention_input.query",
        "model.final_input.query",
    ):
        assert params[fp32].dtype == jnp.float32, fp32


@pytest.mark.slow
def test_multimodal_transformers_layout_sharded_loads_text_and_tower(tiny_checkpoint, tmp_path):
    """`model.language_model.*` and `model.vision_tower.*` over three shards: the text model is the text-only
    checkpoint's, and every tower tensor fills its `vision_tower.*` parameter."""
    config = {
        "model_type": "inkling2",
        "text_config": TINY,
        "image_token_id": 50,
        "vision_config": {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1, "text_hidden_size": 16},
    }
    files = CheckpointFiles(tiny_checkpoint)
    tensors = {name.replace("model.", "model.language_model.", 1): np.array(files.read(name)) for name in files}
    rng = np.random.default_rng(0)
    tower = {
        "model." + path: rng.normal(size=spec.shape).astype(np.float32)
        for path, spec in checkpoint_parameters(parse_config(config), jnp.float32).items()
        if path.startswith("vision_tower.")
    }
    write_sharded(tmp_path, tensors | tower, num_shards=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = jnp.asarray([[5, 9, 1, 33, 2, 7, 40, 11]], jnp.int32)
    _, reference = load_causal_lm(tiny_checkpoint, jnp.float32)
    _, wrapped = load_causal_lm(tmp_path, jnp.float32)
    np.testing.assert_array_equal(np.asarray(wrapped(ids)), np.asarray(reference(ids)))
    loaded = named_parameters(wrapped)
    assert len(tower) == 4 + 2 + 18 + 2
    for name, values in tower.items():
        np.testing.assert_array_equal(np.asarray(loaded[name.removeprefix("model.")]), values, err_msg=name)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: {k: v for k, v in t.items() if k != "model.layers.1.self_attn.k_sconv.static_weight"},
            "missing tensors for model.layers.1.self_attn.k_sconv.static_weight",
        ),
        (
            lambda t: {**t, "model.layers.0.self_attn.extra.weight": np.ones(2, np.float32)},
            "unexpected tensor 'model.layers.0.self_attn.extra.weight'",
        ),
        (
            lambda t: {**t, "model.layers.0.mlp.gate.weight": np.ones((4, 17), np.float32)},
            r"'model.layers.0.mlp.gate.weight' has shape \(4, 17\), the config needs \(4, 16\)",
        ),
        (lambda t: {**t, "model.norm.weight": np.ones(16, np.int32)}, "'model.norm.weight' has dtype int32"),
        (
            lambda t: {
                **t,
                "model.layers.0.mlp.experts.down_proj": t["model.layers.0.mlp.experts.down_proj"].astype(
                    ml_dtypes.float8_e4m3fn
                ),
            },
            "'model.layers.0.mlp.experts.down_proj' holds mxfp8 data but its block-scale sidecar is missing",
        ),
    ],
)
def test_bad_checkpoints_name_the_tensor(tiny_checkpoint, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(edited_copy(tiny_checkpoint, tmp_path, edit), jnp.float32)


def test_quantization_config_must_agree_with_plain_tensors(tiny_checkpoint, tmp_path):
    out = edited_copy(tiny_checkpoint, tmp_path, lambda t: t)
    (out / "config.json").write_text(json.dumps({**TINY, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quantization_config says fp8, but no expert tensor is quantized"):
        load_causal_lm(out, jnp.float32)


def test_synthetic_weights_are_nontrivial(tiny_checkpoint):
    files = CheckpointFiles(tiny_checkpoint)
    for name in files:
        value = files.read(name)
        assert np.std(value) > 0.01, name
        assert not np.allclose(value, 1.0), name
