"""Quantized experts end to end: synthetic checkpoints in the original layout, loading, bad sidecars."""

import json
import logging
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_edits import edited_copy
from flax import nnx

from inkling_jax import score
from inkling_jax.checkpoint import CheckpointError, load_causal_lm
from inkling_jax.checkpoint.loader import parameter_bytes, parameter_paths
from inkling_jax.checkpoint.safetensors_io import INDEX_FILE, CheckpointFiles
from inkling_jax.checkpoint.synthetic import _values, write_checkpoint
from inkling_jax.model.moe import QuantizedWeight
from pallas_kernels.quantized import MXFP8, NVFP4

CONFIG = {
    "model_type": "inkling2_text", "vocab_size": 96, "unpadded_vocab_size": 90, "hidden_size": 64,
    "num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 1, "swa_head_dim": 16, "sliding_window_size": 4, "d_rel": 2, "rel_extent": 6,
    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
    "eos_token_id": 3,
}  # fmt: skip
IDS = jnp.asarray([[5, 17, 3, 44, 60, 2, 71, 8, 30, 12]], jnp.int32)


@pytest.fixture(scope="module")
def config_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.fixture(scope="module")
def mixed(config_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mixed")
    return write_checkpoint(config_path, out, seed=3, experts="mixed", nvfp4_layers=range(2), shard_bytes=40_000)


def test_mixed_checkpoint_is_original_layout_sharded_with_modelopt_sidecars(mixed):
    index = json.loads((mixed / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    files = CheckpointFiles(mixed)
    nv, mx = "model.llm.layers.0.mlp.experts.w13_weight", "model.llm.layers.2.mlp.experts.w13_weight"
    assert files.entry(nv).dtype == np.uint8 and files.entry(nv).shape == (4, 64, 32)
    assert files.entry(nv + "_scale").dtype == ml_dtypes.float8_e4m3fn and files.entry(nv + "_scale").shape == (
        4,
        64,
        4,
    )
    assert files.entry(nv + "_scale_2").shape == (4,)
    assert files.entry(mx).dtype == ml_dtypes.float8_e4m3fn and files.entry(mx + "_scale").shape == (4, 64, 2)
    config = json.loads((mixed / "config.json").read_text())["quantization_config"]
    assert config["quantized_layers"]["model.llm.layers.2.mlp.experts"] == {"quant_algo": "MXFP8"}


@pytest.mark.slow
def test_experts_stay_quantized_and_decode_to_the_generated_weights(mixed):
    _, model = load_causal_lm(mixed, jnp.float32)
    for layer, format in enumerate([NVFP4, NVFP4, MXFP8]):
        experts = model.model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name)
            assert isinstance(weight, QuantizedWeight) and weight.format == format
            decoded = np.asarray(weight.array().dequantize())
            path = f"model.layers.{layer}.mlp.experts.{name}"
            original = np.stack([_values(f"{path}[{e}]", decoded.shape[1:], 3, 0.02) for e in range(4)])
            # within the format's rounding of each value (gate and up rows not swapped)
            error = np.abs(decoded - original).max(axis=-1) / np.abs(original).max(axis=-1)
            assert error.max() < {MXFP8: 2**-3, NVFP4: 0.35}[format], (layer, name)
    assert np.isfinite(np.asarray(model(IDS))).all()


def test_device_bytes_match_the_checkpoint(mixed):
    _, model = load_causal_lm(mixed, jnp.bfloat16)
    checkpoint_bytes = json.loads((mixed / INDEX_FILE).read_text())["metadata"]["total_size"]
    # fp32-kept parameters (convolutions, queries, router weight) are bf16 in the file, so the device
    # holds slightly more; the experts take the same bytes in both
    assert checkpoint_bytes <= parameter_bytes(model) <= 1.2 * checkpoint_bytes
    quantized = sum(v.nbytes for p, v in parameter_paths(nnx.state(model)).items() if ".mlp.experts." in p)
    plain_experts = 3 * 4 * 3 * 64 * 32 * 2  # the same experts in bf16
    assert quantized < 0.6 * plain_experts


@pytest.mark.slow
def test_score_cli_runs_on_a_quantized_checkpoint(mixed, tmp_path, capsys):
    """The scoring command's main() in this process (tests/model/test_parity.py runs it as a process of its own)."""
    (tmp_path / "ids.json").write_text(json.dumps(np.asarray(IDS[0]).tolist()))
    argv = ["--checkpoint", str(mixed), "--input", str(tmp_path / "ids.json"), "--output", str(tmp_path / "out.npy")]
    logger = logging.getLogger("inkling_jax")
    state = list(logger.handlers), logger.level, logger.propagate
    try:
        code = score.main(argv)
    finally:
        logger.handlers[:], logger.level, logger.propagate = state  # main() sends the package's logs to stderr
    assert code == 0, capsys.readouterr().err
    _, model = load_causal_lm(mixed, jnp.float32)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), np.asarray(model(IDS))[0], rtol=1e-5, atol=1e-5)


NV = "model.llm.layers.0.mlp.experts.w13_weight"
MX = "model.llm.layers.2.mlp.experts.w2_weight"


def _nan_mx_scale(t):
    t[MX + "_scale"][1, 2, 0] = 255
    return t


def _nan_nv_scale(t):
    t[NV + "_scale"][0, 0, 0] = np.float32(np.nan)
    return t


def _zero_global(t):
    t[NV + "_scale_2"][2] = 0.0
    return t


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: {k: v for k, v in t.items() if k != NV + "_scale"}, f"'{NV}' holds nvfp4 data but its block-scale"),
        (lambda t: {k: v for k, v in t.items() if k != NV + "_scale_2"}, f"NVFP4 weight '{NV}' has no global scale"),
        (lambda t: {**t, MX + "_scale": t[MX + "_scale"][:, :, :0]}, rf"scale '{MX}_scale' has shape \(4, 64, 0\)"),
        (lambda t: {**t, NV: t[NV].view(np.int8)}, f"'{NV}' \\(int8 .*no known expert format"),
        (_nan_mx_scale, f"tensor '{MX}_scale' holds 1 non-finite value$"),
        (_nan_nv_scale, f"tensor '{NV}_scale' holds 1 non-finite value$"),
        (_zero_global, f"global scale '{NV}_scale_2' must be finite and positive"),
        (lambda t: {**t, NV + ".scale": t[NV + "_scale"]}, "both fill"),
    ],
)
def test_bad_quantized_tensors_are_named(mixed, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(edited_copy(mixed, tmp_path, edit), jnp.float32)


def test_config_must_agree_with_the_tensors(mixed, tmp_path):
    out = edited_copy(mixed, tmp_path, lambda t: t)
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [1, 32], "scale_fmt": "ue8m0"}
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="layer 0 holds nvfp4 experts, which quantization_config"):
        load_causal_lm(out, jnp.float32)
    layers = {"model.llm.layers.2.mlp.experts": {"quant_algo": "NVFP4"}}
    raw["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": layers,
    }
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="says model.llm.layers.2.mlp.experts is .*the tensors hold mxfp8"):
        load_causal_lm(out, jnp.float32)


def test_truncated_shard_is_named(mixed, tmp_path):
    out = tmp_path / "truncated"
    shutil.copytree(mixed, out)
    shard = sorted(out.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}.*byte range"):
        load_causal_lm(out, jnp.float32)


@pytest.mark.slow
def test_orbax_round_trip_keeps_experts_quantized(mixed, tmp_path):
    from inkling_jax.checkpoint import load_model
    from inkling_jax.checkpoint.orbax_io import save

    _, loaded = load_causal_lm(mixed, jnp.bfloat16)
    saved = save(loaded, mixed / "config.json", tmp_path / "orbax")
    _, restored = load_model(saved, jnp.bfloat16)
    assert isinstance(restored.model.layers[0].mlp.experts.down_proj, QuantizedWeight)
    for path, variable in parameter_paths(nnx.state(loaded)).items():
        restored_value = parameter_paths(nnx.state(restored))[path][...]
        assert restored_value.dtype == variable.dtype, path
        np.testing.assert_array_equal(
            np.asarray(restored_value).view(np.uint8), np.asarray(variable[...]).view(np.uint8)
        )
    with pytest.raises(CheckpointError, match="holds bfloat16 parameters"):
        load_model(saved, jnp.float32)
    (saved / "inkling_jax.json").write_text("{")
    with pytest.raises(CheckpointError, match="unreadable inkling_jax.json"):
        load_model(saved, jnp.bfloat16)
