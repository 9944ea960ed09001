"""`--load-format dummy`: random weights of a config built on the devices, in the checkpoint's expert formats and
with its draft, served through the scheduler; the one-H200 proxy config."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from model_configs import four_layers
from paths import REPO

from inkling_jax.checkpoint import CheckpointError, load_model
from inkling_jax.checkpoint.dummy import HASH_PRNG, dummy_model, random_model
from inkling_jax.checkpoint.loader import abstract_causal_lm
from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.checkpoint.synthetic import main as synthetic_main
from inkling_jax.config import load_config
from inkling_jax.generate import main as generate_main
from inkling_jax.model.attn_res import BlockAttentionResidual
from inkling_jax.model.moe import QuantizedWeight
from inkling_jax.model.norms import RMSNorm, ScaledL2Clip
from inkling_jax.model.params import Linear
from inkling_jax.param_count import count_parameters
from inkling_jax.sharding import make_mesh, parameter_shardings
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray

TINY = REPO / "configs" / "tiny_text.json"  # 12 layers, a 2-layer DSpark draft
PROXY = REPO / "configs" / "proxy_h200.json"


def placement(model: nnx.Module) -> dict:
    """Every parameter's path, shape, dtype and sharding."""
    leaves = jax.tree.leaves_with_path(nnx.state(model))
    return {jax.tree_util.keystr(path): (leaf.shape, leaf.dtype, leaf.sharding) for path, leaf in leaves}


@pytest.mark.slow
def test_dummy_model_is_laid_out_as_the_checkpoint_would_load(tmp_path):
    """A synthetic checkpoint with mixed NVFP4 / MXFP8 experts and a draft, loaded at tp4, against a dummy model
    of its config.json at tp4: the same parameters, shapes, dtypes (the quantized experts as data + scales) and
    shards, with random values that differ from the checkpoint's."""
    from inkling_jax.checkpoint.synthetic import write_checkpoint

    checkpoint = write_checkpoint(TINY, tmp_path / "mixed", experts="mixed", nvfp4_layers=range(0, 7), seed=3)
    config = load_config(checkpoint)
    mesh = make_mesh("tp4", config.text)
    _, loaded = load_model(checkpoint, np.float32, mesh)
    dummy = dummy_model(config, np.float32, mesh, seed=5)
    assert placement(dummy) == placement(loaded)
    assert dummy.dspark is not None
    embedding = np.asarray(dummy.model.embed_tokens.weight[...])
    assert embedding.std() > 0 and not np.array_equal(embedding, np.asarray(loaded.model.embed_tokens.weight[...]))


@pytest.mark.slow
def test_a_random_model_is_the_abstract_model_with_values_as_its_initialisers_draw_them():
    """The tiny config with NVFP4, MXFP8 and plain experts at the places of its blocks (one segment of two),
    built at tp4: every parameter has the abstract model's shape and dtype and the shards the rules give it;
    norm gains and clip scales are ones, attention-residual queries and biases zeros, the normal draws (every
    projection, the quantized experts decoded) finite with the configured std, each layer of a stack its own;
    the same values when built on one device."""
    config = load_config(TINY)
    formats = [NVFP4, MXFP8, None, NVFP4, MXFP8, None] * 2
    mesh = make_mesh("tp4", config.text)
    model = random_model(config, np.float32, mesh, formats, seed=3)
    abstract = abstract_causal_lm(config, np.float32, formats)
    assert nnx.graphdef(model) == nnx.graphdef(abstract)
    shardings = dict(nnx.to_flat_state(parameter_shardings(abstract, mesh)))
    expected = {path: (v.shape, v.dtype, shardings[path]) for path, v in nnx.to_flat_state(nnx.state(abstract))}
    built = {path: (v[...].shape, v[...].dtype, v[...].sharding) for path, v in nnx.to_flat_state(nnx.state(model))}
    assert built == expected
    values = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}
    assert all(np.isfinite(value).all() for value in values.values())

    std = config.text.initializer_range
    dequantize = jax.jit(QuantizedArray.dequantize)
    for _, module in nnx.iter_graph(model):
        if isinstance(module, RMSNorm):
            np.testing.assert_array_equal(module.weight[...], 1.0)
        elif isinstance(module, ScaledL2Clip):
            np.testing.assert_array_equal(module.scale[...], 1.0)
        elif isinstance(module, BlockAttentionResidual):
            np.testing.assert_array_equal(module.query[...], 0.0)
        elif isinstance(module, Linear) and module.weight.size >= 1000:  # fewer draws, more noise in their std
            weight = np.asarray(module.weight[...])
            assert abs(weight.mean()) < 0.1 * std and weight.std() == pytest.approx(std, rel=0.1)
        elif isinstance(module, QuantizedWeight):
            weight = np.asarray(dequantize(module.array()))
            assert np.isfinite(weight).all() and weight.std() == pytest.approx(std, rel=0.1)
    np.testing.assert_array_equal(model.model.segments[0].positions[0].mlp.gate.e_score_correction_bias[...], 0.0)
    np.testing.assert_array_equal(model.dspark.confidence_head.proj.bias[...], 0.0)
    layers_1_and_7 = np.asarray(model.model.segments[0].positions[1].self_attn.q_proj.weight[...])
    assert abs(np.corrcoef(layers_1_and_7[0].ravel(), layers_1_and_7[1].ravel())[0, 1]) < 0.1

    on_one_device = random_model(config, np.float32, make_mesh("tp1", config.text), formats, seed=3)
    for path, v in nnx.to_flat_state(nnx.state(on_one_device)):
        np.testing.assert_array_equal(v[...], values[path], err_msg=str(path))


def test_the_hash_prng_draws_like_jax_random():
    """HASH_PRNG, the random builds' generator: uniform bits, normal draws of mean 0 and std 1, keys that split and
    fold in to distinct streams (fold_in does not commute), other values for another seed, and the same values
    however the draw is sharded."""
    key = jax.random.key(3, impl=HASH_PRNG)
    counts = np.bincount(np.asarray(jax.random.bits(key, (1 << 16,), jnp.uint8)), minlength=256)
    assert ((counts - 256) ** 2 / 256).sum() < 340  # chi-square, 255 degrees of freedom: p ~ 0.0003
    normal = np.asarray(jax.random.normal(key, (512, 512)))
    assert abs(normal.mean()) < 0.01 and normal.std() == pytest.approx(1.0, abs=0.01)
    other = np.asarray(jax.random.normal(jax.random.key(4, impl=HASH_PRNG), (512, 512)))
    assert abs(np.corrcoef(normal.ravel(), other.ravel())[0, 1]) < 0.01

    keys = [jax.random.key_data(k) for k in jax.random.split(key, 1000)]
    keys += [jax.random.key_data(jax.random.fold_in(key, i)) for i in range(100)]
    keys += [jax.random.key_data(jax.random.fold_in(jax.random.fold_in(key, b), a)) for a, b in ((1, 2), (2, 1))]
    assert len({tuple(np.asarray(k).tolist()) for k in keys}) == len(keys)

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    split = NamedSharding(mesh, PartitionSpec("data", None, "model"))
    sharded = jax.jit(lambda k: jax.random.normal(k, (16, 8, 64)), out_shardings=split)(key)
    np.testing.assert_array_equal(sharded, jax.jit(lambda k: jax.random.normal(k, (16, 8, 64)))(key))


@pytest.mark.parametrize(
    ("quantization", "formats"),
    [
        (None, [None] * 4),
        ({"quant_method": "fp8", "weight_block_size": [1, 32]}, [MXFP8] * 4),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, [NVFP4] * 4),
        (
            {
                "quant_method": "modelopt",
                "quant_algo": "MIXED_PRECISION",
                "quantized_layers": {
                    "model.llm.layers.0.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
                    "model.llm.layers.2.mlp.experts": {"quant_algo": "MXFP8"},
                },
            },
            [NVFP4, None, MXFP8, None],
        ),
    ],
)
def test_expert_formats_follow_the_quantization_config(quantization, formats):
    assert configured_expert_formats("c.json", quantization, 4) == formats


@pytest.mark.parametrize(
    ("quantization", "message"),
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"quant_method": "modelopt", "quant_algo": "INT4"}, "quant_algo 'INT4' is not supported"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.9.mlp.experts": {"quant_algo": "MXFP8"}}}, "no layer of the model"),
        ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
            "model.layers.1.mlp.experts": {"quant_algo": "FP8"}}}, "not NVFP4 or MXFP8"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "not MXFP8's [1, 32]"),
    ],
)  # fmt: skip
def test_unsupported_quantization_configs_are_named(quantization, message):
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[")):
        configured_expert_formats("c.json", quantization, 4)


def run_generate(tmp_path: Path, lines: list[dict], *options: str) -> tuple[int, list[dict]]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    out.unlink(missing_ok=True)
    code = generate_main(["--input", str(tmp_path / "in.jsonl"), "--output", str(out), "--quiet", *options])
    return code, [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


@pytest.mark.slow
def test_generate_on_a_dummy_model_from_a_config_file(tmp_path, capsys):
    """The tiny config (four layers) with mixed experts and its draft, as a config file: generation through the
    scheduler at tp2, and at tp1 speculating from a directory of the config and its tokenizer alone, gives the same
    greedy tokens (the random weights depend on neither the shards nor the source) and serves text there."""
    config = json.loads(four_layers(TINY, tmp_path / "four_layers.json").read_text())
    config["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {
            f"model.llm.layers.{i}.mlp.experts": {"quant_algo": "NVFP4" if i < 2 else "MXFP8"} for i in range(4)
        },
    }
    (tmp_path / "mixed.json").write_text(json.dumps(config))
    rng = np.random.default_rng(7)
    lines = [
        {
            "id": i,
            "prompt_token_ids": rng.integers(0, 500, int(rng.integers(2, 20))).tolist(),
            "max_tokens": 9,
            "temperature": 0.8 * (i % 2),
            "seed": i,
        }
        for i in range(5)
    ]
    common = [
        "--checkpoint",
        str(tmp_path / "mixed.json"),
        "--load-format",
        "dummy",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "2",
        "--chunk",
        "8",
    ]
    code, one = run_generate(tmp_path, lines, *common, "--mesh", "tp2")
    assert code == 0 and [r["id"] for r in one] == list(range(5))
    assert all(len(r["token_ids"]) == 9 or r["finish_reason"] == "stop" for r in one)
    assert all("text" not in r for r in one)  # a dummy model from a config file has no tokenizer
    code, _ = run_generate(tmp_path, [{"id": 0, "prompt": "hello"}], *common)
    assert code == 2 and "'prompt' (text) needs a tokenizer" in capsys.readouterr().err
    # a directory of config and tokenizer alone: the same random weights, and text served
    synthetic_main(["--config", str(tmp_path / "mixed.json"), "--out", str(tmp_path / "text"), "--no-weights"])
    assert sorted(p.name for p in (tmp_path / "text").iterdir()) == [
        "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"
    ]  # fmt: skip
    capsys.readouterr()
    pattern = "[a-d]{2,6}-[0-9]{1,3}"  # beside speculating requests, a constrained one samples after each step
    constrained = {"id": 6, "prompt_token_ids": [7, 8, 9], "temperature": 0.9, "seed": 3, "max_tokens": 20}
    with_text = [
        *lines,
        {"id": 5, "prompt": "hello there", "max_tokens": 4},
        {**constrained, "constraint": {"regex": pattern}},
    ]
    on_text = ["--checkpoint", str(tmp_path / "text"), *common[2:]]
    code, speculating = run_generate(tmp_path, with_text, *on_text, "--speculative", "dspark")
    assert code == 0 and all(isinstance(r["text"], str) for r in speculating) and speculating[5]["token_ids"]
    assert speculating[6]["finish_reason"] == "stop" and re.fullmatch(pattern, speculating[6]["text"])
    for plain, speculated in zip(one, speculating[:5], strict=True):
        if plain["id"] % 2 == 0:  # greedy: speculation changes nothing
            assert speculated["token_ids"] == plain["token_ids"]
        assert speculated["acceptance_length"] >= 1.0
    code, _ = run_generate(tmp_path, lines, *common[:2], "--dtype", "float32")  # the default format reads weights
    assert code == 2 and "is not a checkpoint directory" in capsys.readouterr().err


def test_the_proxy_config_is_the_full_model_with_16_experts_in_native_formats():
    """configs/proxy_h200.json: every width and all 48 layers of configs/inkling2_small.json, 16 routed experts
    (top 8), NVFP4 experts on layers 0-39 and MXFP8 on 40-47 stated as the native checkpoint states them, and a
    DSpark draft; its parameters fit one H200 with room for the decode state."""
    full, proxy = load_config(REPO / "configs" / "inkling2_small.json"), load_config(PROXY)
    assert (proxy.text.n_routed_experts, proxy.text.num_experts_per_tok) == (16, 8)
    for field in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "moe_intermediate_size",
        "vocab_size",
        "sliding_window_size",
        "layer_types",
        "d_rel",
    ):
        assert getattr(proxy.text, field) == getattr(full.text, field), field
    assert proxy.quantization["quant_algo"] == "MIXED_PRECISION"
    formats = configured_expert_formats(str(PROXY), proxy.quantization, proxy.text.num_hidden_layers)
    assert formats == [NVFP4] * 40 + [MXFP8] * 8
    assert proxy.draft is not None and max(proxy.draft.target_layer_ids) < 48
    counts = count_parameters(proxy)
    assert counts.total < 40e9
